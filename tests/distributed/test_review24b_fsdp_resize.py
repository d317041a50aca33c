"""An FSDP2 model probed twice under the simulated device (one process, a one-rank gloo group).

FSDP2 allocates each unsharded parameter with ``untyped_storage().resize_(n)`` and frees it with
``resize_(0)``; the simulated device did not see either. A first probe counted the all-gather
buffers it created and never gave them back; a second probe (the buffers already made) counted
none of them and answered too high: a fresh model's Runner at that size ran out of memory.
Now both probes agree, and a fresh model trains at their answer without a recovery.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autobatch
from autobatch.memory.simulated import simulated_memory
from one_rank import one_rank_mesh  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

LIMIT = "1MiB"


def _sharded(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)], nn.Linear(128, 1))
    for block in model[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _loss(model, batch):
    return model(batch).pow(2).mean()


def test_a_second_probe_of_an_fsdp2_model_answers_what_a_fresh_model_trains(one_rank_mesh):
    model, optimizer = _sharded(one_rank_mesh)
    step = autobatch.TrainStep(model, optimizer, _loss, lambda n: torch.randn(n, 128))
    first = autobatch.find_max_batch(step, memory_limit=LIMIT, cache=False).batch_size
    second = autobatch.find_max_batch(step, memory_limit=LIMIT, cache=False).batch_size
    assert second == first  # before: the second answered higher (FSDP2's buffers counted 0)
    fresh, fresh_optimizer = _sharded(one_rank_mesh)
    runner = autobatch.Runner(fresh, fresh_optimizer, _loss, global_batch=second, micro_batch=second,
                              progress=False, distributed=True, grow_after=None)
    with simulated_memory(LIMIT):
        result = runner.fit([torch.randn(second, 128)] * 2)
    assert result.steps == 2 and result.oom_recoveries == []  # before: the fresh model OOMed at it
