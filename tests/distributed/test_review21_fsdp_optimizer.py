"""An FSDP2 model whose optimizer was built before ``fully_shard`` (one process, no launch).

``fully_shard`` replaces each parameter with a sharded ``DTensor``. An optimizer built between
sharding the blocks and sharding the root (a common ordering slip) held the blocks' new
DTensors and the root's *old* embedding and head tensors: the runner trained, the loss went
down, and the embedding and head never changed, without a word. Now the runner's first step and
the probe refuse it with one error naming the parameters and the fix
(``autobatch.probe.snapshot.shards.check_optimizer_after_sharding``). In process: a one-rank gloo group
on a ``HashStore`` and a one-rank CPU mesh, destroyed after the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from one_rank import one_rank_mesh  # noqa: F401 - the fixture

import autobatch
from autobatch.dist.fsdp import FsdpProbeAgreement

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Linear(4, 8), nn.Linear(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        x = self.emb(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _mse(model, batch):
    return (model(batch) - 1).pow(2).mean()


def test_an_optimizer_built_before_the_roots_fully_shard_is_one_clear_error(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    for block in model.blocks:
        fully_shard(block, mesh=one_rank_mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the root's old emb and head
    fully_shard(model, mesh=one_rank_mesh)
    before = model.emb.weight.to_local().clone()
    fix = r"emb\.weight, emb\.bias, head\.weight, head\.bias .*built before fully_shard.*after the last fully_shard call"
    for distributed in (True, False):  # refused where the step is built, one rank's single-process path too
        with pytest.raises(ValueError, match=fix):  # before: trained, emb and head never moved
            autobatch.Runner(model, optimizer, _mse, global_batch=8, micro_batch=4, progress=False, distributed=distributed)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)  # built after: trains
    step = autobatch.TrainStep(model, fresh, _mse, lambda n: torch.randn(n, 4))
    step.optimizer = optimizer  # swapped after the step was built: the FSDP step's own check
    with pytest.raises(ValueError, match=fix):
        FsdpProbeAgreement().local_step(step)  # the probe's FSDP path under torchrun
    runner = autobatch.Runner(model, fresh, _mse, global_batch=8, micro_batch=4, progress=False, distributed=True)
    assert runner.fit([torch.randn(8, 4)]).steps == 1 and not torch.equal(model.emb.weight.to_local(), before)
    early = _Net()
    stale = torch.optim.SGD(early.parameters(), lr=0.1)  # before any fully_shard: holds none of the new ones
    fully_shard(early, mesh=one_rank_mesh)
    with pytest.raises(ValueError, match="built before fully_shard"):
        autobatch.TrainStep(early, stale, _mse, lambda n: torch.randn(n, 4))
