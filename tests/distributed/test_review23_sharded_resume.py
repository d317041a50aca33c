"""Review 23: a sharded (FSDP2) checkpoint resumed as an unsharded one is: same state, same checks.

One process, no launch: a one-rank gloo group on a ``HashStore`` and a one-rank CPU mesh,
destroyed after each test. Before:

* a custom optimizer's own state (``self.state["count"] = tensor`` at the top level, or a
  parameter's state kept as one bare tensor) saved, but its sharded resume was refused
  ("invalid literal for int() with base 10: 'count'", "'Tensor' object has no attribute
  'items'"), and the probe's cache key of such an optimizer raised "values expected sparse
  tensor layout";
* bfloat16 shards resumed into a float32 model were cast without the warning an unsharded
  resume gives (``precision.check_dtypes``);
* a model with an extra parameter, or an optimizer with other parameter groups, failed only while
  loading: the scheduler (and, for the groups, the weights) were the checkpoint's already;
* a missing checkpoint (``resume="latest"``, which only the command line knows) said neither
  what to give nor how.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from one_rank import one_rank_mesh  # noqa: F401 - the fixture

from autobatch import Runner
from autobatch.errors import CheckpointError

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

G = 8


class Counting(torch.optim.SGD):
    """SGD that counts its steps in a tensor of its own, at the state's top level."""

    def __init__(self, params):
        super().__init__(params, lr=0.1, momentum=0.9)

    def step(self, closure=None):
        self.state["count"] = self.state.get("count", torch.tensor(0)) + 1
        return super().step(closure)


class BareMomentum(torch.optim.Optimizer):
    """Momentum SGD whose state per parameter is the buffer itself, not a dict."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                buffer = self.state.get(param)
                buffer = param.grad.clone() if not isinstance(buffer, torch.Tensor) else buffer.mul_(0.9).add_(param.grad)
                self.state[param] = buffer
                param.add_(buffer, alpha=-group["lr"])


class _Net(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        if extra:
            self.extra = nn.Linear(1, 1)  # not used in forward: a parameter the checkpoint lacks

    def forward(self, x):
        return self.head(torch.tanh(self.body(x.to(self.body.weight.dtype)))).float()


def _model(one_rank_mesh, dtype=torch.float32, extra=False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net(extra).to(dtype)
    fully_shard(model, mesh=one_rank_mesh)
    return model


def _data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(G, 4, generator=generator), torch.randn(G, 1, generator=generator)) for _ in range(2)]


def _loss(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _runner(model, optimizer, **kwargs):
    return Runner(model, optimizer, _loss, global_batch=G, micro_batch=4, progress=False, **kwargs)


def _shards(model):
    return {name: value.to_local().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("optimizer_class", [Counting, BareMomentum])
def test_a_custom_optimizers_own_state_resumes_sharded_as_the_straight_run(one_rank_mesh, tmp_path, optimizer_class):
    first = _model(one_rank_mesh)
    _runner(first, optimizer_class(first.parameters()), checkpoint_dir=tmp_path).fit(_data(), epochs=1)
    resumed = _model(one_rank_mesh)
    optimizer = optimizer_class(resumed.parameters())
    _runner(resumed, optimizer).fit(_data(), epochs=2, resume=tmp_path)  # before: refused as "another model"
    straight = _model(one_rank_mesh)
    reference = optimizer_class(straight.parameters())
    _runner(straight, reference).fit(_data(), epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(_shards(resumed).values(), _shards(straight).values()))
    if optimizer_class is Counting:
        assert optimizer.state["count"].item() == reference.state["count"].item() == 4
    else:
        buffers = [optimizer.state[p] for p in resumed.parameters()]
        assert all(type(b).__name__ == "DTensor" for b in buffers)  # laid out as its parameter, as torch's state is
        assert all(torch.equal(b.to_local(), reference.state[p].to_local()) for b, p in zip(buffers, straight.parameters()))


def test_the_cache_key_of_an_optimizer_with_bare_state_counts_it(one_rank_mesh):
    from autobatch.probe.caching.cache_key import step_components
    from autobatch.probe.train_step import TrainStep

    counts = {}
    for optimizer_class in (Counting, BareMomentum):
        model = _model(one_rank_mesh)
        optimizer = optimizer_class(model.parameters())
        _runner(model, optimizer).fit(_data(), steps=1)
        step = TrainStep(model, optimizer, _loss, lambda n: (torch.randn(n, 4), torch.randn(n, 1)))
        # before: "values expected sparse tensor layout but got Strided" (Tensor.values() on the bare tensors)
        counts[optimizer_class] = step_components(step)["optimizer"]["state_tensors"]
    params = len(list(model.parameters()))
    assert counts == {Counting: params + 1, BareMomentum: params}  # SGD momentum buffers (+ the count); one buffer each


@pytest.mark.parametrize(("saved", "resumed"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_shards_of_another_dtype_warn_as_an_unsharded_resume_does(one_rank_mesh, tmp_path, caplog, saved, resumed):
    first = _model(one_rank_mesh, saved)
    _runner(first, torch.optim.AdamW(first.parameters()), checkpoint_dir=tmp_path).fit(_data(), epochs=1)
    model = _model(one_rank_mesh, resumed)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        _runner(model, torch.optim.AdamW(model.parameters())).fit(_data(), epochs=2, resume=tmp_path)
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    assert f"4 tensor(s) saved in {name(saved)} load into this run's {name(resumed)}" in caplog.text  # before: silent
    assert ("rounded" in caplog.text) == (resumed == torch.bfloat16)
    assert model.body.weight.dtype == resumed


def test_a_resume_that_does_not_fit_is_refused_before_anything_is_loaded(one_rank_mesh, tmp_path):
    first = _model(one_rank_mesh)
    optimizer = torch.optim.AdamW(first.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    _runner(first, optimizer, scheduler=scheduler, checkpoint_dir=tmp_path).fit(_data(), epochs=1)

    extra = _model(one_rank_mesh, extra=True)  # a parameter the checkpoint lacks
    optimizer = torch.optim.AdamW(extra.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    before = _shards(extra)
    with pytest.raises(CheckpointError, match=r"this model has parameter\(s\) the checkpoint lacks: extra\.bias, extra\.weight"):
        _runner(extra, optimizer, scheduler=scheduler).fit(_data(), epochs=2, resume=tmp_path)
    assert scheduler.last_epoch == 0  # before: the checkpoint's scheduler state was loaded first
    assert all(torch.equal(before[k], v) for k, v in _shards(extra).items())

    split = _model(one_rank_mesh)  # the same model, its optimizer's parameters in two groups
    params = list(split.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    before = _shards(split)
    with pytest.raises(CheckpointError, match=r"optimizer parameter groups of \[4\] parameters \(this optimizer: \[2, 2\]\)"):
        _runner(split, optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1)).fit(_data(), epochs=2, resume=tmp_path)
    assert all(torch.equal(before[k], v) for k, v in _shards(split).items())  # before: the weights were loaded
    assert not optimizer.state


def test_a_missing_sharded_checkpoint_says_what_to_give(one_rank_mesh, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model(one_rank_mesh)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at gone .*gone\.rank<r>-of-1\.pt next to it\): give "
                                                r"the last\.pt a runner wrote, or its checkpoint_dir"):
        _runner(model, torch.optim.AdamW(model.parameters())).fit(_data(), epochs=1, resume="gone")
