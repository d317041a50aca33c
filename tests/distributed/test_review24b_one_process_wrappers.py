"""A one-process runner given a data-parallel wrapper (one process, a one-rank gloo group).

1. ``Runner(ddp, ..., no_sync=ddp.no_sync)`` with ``static_graph=True`` failed at the first
   accumulated step with torch's "expect_autograd_hooks_ INTERNAL ASSERT FAILED", naming nothing
   to change (a hand-written ``no_sync`` loop fails the same: torch's limit). Now
   :func:`autobatch.training.ranks.check_no_sync` refuses it before training, naming the fix.
2. ``Runner(wrapped, ..., distributed=False)`` in a job of several ranks ran the wrapper's
   collectives with no OOM vote: one rank's OOM left the others waiting until the timeout. Now
   ``fit()`` refuses it before any step (the wrapper's span mocked to 2 ranks, where the check
   asks ``torch.distributed`` for it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autobatch
from autobatch.training import ranks
from one_rank import one_rank_mesh  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

STATIC_FIX = r"static_graph=True.*Drop no_sync=.*static_graph=False"


def _loss(model, batch):
    return model(batch).pow(2).mean()


def test_no_sync_of_a_static_graph_ddp_is_refused_in_one_process(one_rank_mesh):
    torch.manual_seed(0)
    static = nn.parallel.DistributedDataParallel(nn.Linear(4, 1), static_graph=True)
    with pytest.raises(ValueError, match=STATIC_FIX):
        ranks.check_no_sync(static.no_sync, distributed=False)
    ranks.check_no_sync(static.no_sync, distributed=True)  # the distributed step never calls it
    plain = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    ranks.check_no_sync(plain.no_sync, distributed=False)
    ranks.check_no_sync(None, distributed=False)
    with pytest.raises(ValueError, match=STATIC_FIX):  # the runner asks when it is built, before any step
        autobatch.Runner(static, torch.optim.SGD(static.parameters(), lr=0.1), _loss, global_batch=8, micro_batch=4,
                         device="cpu", progress=False, no_sync=static.no_sync, distributed=False)
    with pytest.raises(RuntimeError, match="expect_autograd_hooks_"):  # what the refusal spares: torch's own limit
        with static.no_sync():
            _loss(static, torch.randn(4, 4)).backward()
        _loss(static, torch.randn(4, 4)).backward()


def test_distributed_false_with_a_wrapper_over_several_ranks_is_refused_before_any_step(one_rank_mesh, monkeypatch):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=4,
                              progress=False, micro_batch=4, distributed=False)
    assert runner.fit([torch.randn(4, 4)]).steps == 1  # a wrapper over one rank: trains as one process
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # the wrapper's group: 2 ranks
    with pytest.raises(ValueError, match=r"distributed=False.*collectives over 2 ranks.*distributed=None.*ddp\.module"):
        runner.fit([torch.randn(4, 4)])  # before: trained, and a rank's OOM left its peers waiting
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert ranks.wrapper_ranks(model.module) == 1  # unwrapped: each rank alone, as asked


def test_a_sharded_model_counts_its_mesh(one_rank_mesh, monkeypatch):
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), mesh=one_rank_mesh)
    assert ranks.wrapper_ranks(model) == 1
    monkeypatch.setattr(type(one_rank_mesh), "size", lambda self, mesh_dim=None: 2)
    assert ranks.wrapper_ranks(model) == 2
    assert "fully_shard" in ranks.alone_with_wrapper(type(model).__name__, 2)
