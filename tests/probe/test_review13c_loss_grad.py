"""A loss with no autograd graph (detached, or of a model whose parameters are all frozen) is one
error saying what to change, from a probe, a TrainStep and a Runner (review 13c); before, torch's
bare ``RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn``."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch import TrainStep


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data(n):
    return torch.randn(n, 8)


def _frozen():
    model = _model().requires_grad_(False)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean()


def _detached():
    model = _model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: torch.tensor(m(b).pow(2).mean().item())


@pytest.mark.parametrize("case", [_frozen, _detached], ids=["frozen", "detached"])
@pytest.mark.parametrize("entry", ["probe", "train_step", "runner"])
def test_a_loss_without_grad_says_what_to_change(case, entry):
    model, optimizer, loss_fn = case()
    step = TrainStep(model, optimizer, loss_fn, _data)
    with pytest.raises(ValueError, match=r"does not require grad.*\.detach\(\).*requires_grad=True") as caught:
        if entry == "probe":
            autobatch.find_max_batch(step, max_batch=8, cache=False)
        elif entry == "train_step":
            step(4)
        else:
            autobatch.Runner(model, optimizer, loss_fn, global_batch=8, device="cpu").fit([_data(8)], epochs=1)
    assert "requires_grad_(True)" in str(caught.value)


def test_a_step_run_under_no_grad_is_told_to_leave_it():
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(), _data)
    with torch.no_grad(), pytest.raises(ValueError, match=r"gradients are off .*inside torch\.no_grad\(\)"):
        step(4)


def test_partly_frozen_and_adapter_models_train_as_before():
    base = _model().requires_grad_(False)
    adapter = torch.nn.Linear(8, 8)  # LoRA-style: only the adapter trains
    model = torch.nn.ModuleDict({"base": base, "adapter": adapter})
    loss_fn = lambda m, b: m["base"](b + m["adapter"](b)).pow(2).mean()  # noqa: E731
    before = {k: v.clone() for k, v in model.state_dict().items()}
    TrainStep(model, torch.optim.AdamW(adapter.parameters()), loss_fn, _data)(4)
    after = model.state_dict()
    assert not torch.equal(before["adapter.weight"], after["adapter.weight"])  # trained
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("base."))
    head_only = _model()
    head_only[0].requires_grad_(False)
    TrainStep(head_only, torch.optim.SGD(head_only[2].parameters(), lr=0.1), lambda m, b: m(b).sum(), _data)(4)


def test_another_runtime_error_of_backward_is_not_retyped():
    def loss_fn(model, batch):
        out = model(batch).sigmoid()  # sigmoid saves its output for backward
        loss = out.sum()
        out.add_(1)  # ... which this in-place write invalidates
        return loss

    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, _data)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(4)
