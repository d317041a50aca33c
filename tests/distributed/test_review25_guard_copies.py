"""The runner's step guard copies FSDP2 shards without autograd views, and groups its copies by
device (the FSDP2 step overhead measured on 2 x H200 in docs/distributed.md, "On GPUs")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch.training.oom.step_guard import StepGuard, copy_all
from one_rank import one_rank_mesh  # noqa: F401  (fixture)


def _sharded_adamw(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def test_the_guard_captures_and_restores_fsdp2_shards_without_to_local(one_rank_mesh, monkeypatch):
    """``DTensor.to_local()`` is an autograd op (about 10 us a tensor); the guard reads each shard
    directly, every step, and still puts the exact values back after a failed step."""
    from torch.distributed.tensor import DTensor

    model, optimizer = _sharded_adamw(one_rank_mesh)
    guard = StepGuard(optimizer, "cpu")

    def refused(self, *args, **kwargs):
        raise AssertionError("the guard called DTensor.to_local()")

    monkeypatch.setattr(DTensor, "to_local", refused)
    guard.capture()
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    moments = [s["exp_avg"].full_tensor().clone() for s in optimizer.state.values()]
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()  # the step a failure would have half-applied
    guard.restore()
    assert all(torch.equal(p.full_tensor(), before[name]) for name, p in model.named_parameters())
    assert all(torch.equal(s["exp_avg"].full_tensor(), m) for s, m in zip(optimizer.state.values(), moments))


def test_copies_are_grouped_by_device_pair(monkeypatch):
    """A list that mixes devices (AdamW's CPU step counters among CUDA moments) sent every copy of
    it down torch's one-by-one path: each pair of devices is one ``_foreach_copy_`` call now."""
    calls = []
    real = torch._foreach_copy_

    def recording(targets, sources, non_blocking=False):
        calls.append({(t.device.type, s.device.type) for t, s in zip(targets, sources)})
        if all(t.device.type == "cpu" for t in targets):
            real(targets, sources, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    cpu = [torch.zeros(3), torch.zeros(2)]
    meta = [torch.empty(4, device="meta"), torch.empty(5, device="meta")]
    sources = [torch.ones(3), torch.empty(4, device="meta"), torch.full((2,), 2.0), torch.empty(5, device="meta")]
    copy_all([cpu[0], meta[0], cpu[1], meta[1]], sources)
    assert sorted(map(sorted, calls)) == [[("cpu", "cpu")], [("meta", "meta")]]
    assert torch.equal(cpu[0], torch.ones(3)) and torch.equal(cpu[1], torch.full((2,), 2.0))
