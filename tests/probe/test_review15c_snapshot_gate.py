"""The background snapshot's forward gate (a global forward pre-hook that holds a forward until
the parameters outside the optimizer are copied) goes once it has let the first forward through:
left until the restore, a ``torch.compile``d model ran eagerly through every trial."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.modules import module as torch_module

from autobatch import TrainStep, find_max_batch, simulated_memory
from autobatch.probe.snapshot.restore import Snapshot


def _frozen_tail_step(model: torch.nn.Module, seen: list[int]) -> TrainStep:
    """A step whose optimizer (with state: no learning-rate-0 trials) leaves ``model[1]`` out."""
    plain = getattr(model, "_orig_mod", model)
    for param in plain[1].parameters():
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW(plain[0].parameters())
    plain(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

    def loss(m, batch):
        out = m(batch).square().mean()
        seen.append(len(torch_module._global_forward_pre_hooks))  # after the forward
        return out

    return TrainStep(model, optimizer, loss, lambda n: torch.randn(n, 8))


def test_the_gate_goes_after_the_first_forward_of_a_probe():
    seen: list[int] = []
    step = _frozen_tail_step(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), seen)
    before = len(torch_module._global_forward_pre_hooks)
    with simulated_memory("4MiB"):
        find_max_batch(step, strategy="binary", max_batch=4, cache=False)
    assert seen and set(seen) == {before}  # no gate left once a forward ran
    assert len(torch_module._global_forward_pre_hooks) == before


@pytest.mark.filterwarnings("ignore:Using `torch.compile")
def test_a_compiled_model_compiles_under_a_background_snapshot():
    """(Outside a simulated budget, whose dispatch mode dynamo skips.) With the gate left in
    place, dynamo compiled no frame of the model."""
    torch._dynamo.reset()
    counter, seen = CompileCounter(), []
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), backend=counter)
    step = _frozen_tail_step(model, seen)
    snapshot = Snapshot.take(model._orig_mod, step.optimizer, background=True)
    try:
        assert snapshot._gate is not None  # model[1] is outside the optimizer: the gate is on
        for _ in range(2):
            model(torch.randn(2, 8))
        assert snapshot._gate is None
        assert counter.frame_count >= 1
    finally:
        snapshot.restore()
        torch._dynamo.reset()


def test_the_gate_is_removed_when_no_forward_ever_runs():
    """A probe whose every trial fails before forward (the data raises) still removes it."""
    seen: list[int] = []
    step = _frozen_tail_step(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), seen)
    step.make_batch = lambda n: (_ for _ in ()).throw(ValueError("the data's own error"))
    before = len(torch_module._global_forward_pre_hooks)
    with simulated_memory("4MiB"):
        try:
            find_max_batch(step, strategy="binary", max_batch=4, cache=False)
        except ValueError:
            pass
    assert len(torch_module._global_forward_pre_hooks) == before
