"""A one-rank DDP model (``torchrun --nproc-per-node 1``) with a parameter its forward never uses
and DDP's default ``find_unused_parameters=False`` (one process: a one-rank gloo group on a
``HashStore``, no launch). DDP's own error ("Expected to have finished reduction in the prior
iteration ... find_unused_parameters=True") must reach the user unchanged: the probe and the
runner recover a failed reduction after an OOM (``autobatch.probe.snapshot.ddp_reducer``), and that must
not turn this error into an OOM, a retry or a smaller micro-batch. The steps done before it are kept.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autobatch
from autobatch import TrainStep

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

DDP_SAYS = r"Expected to have finished reduction in the prior iteration.*find_unused_parameters=True"


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.fixture
def unused_ddp():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        yield lambda: nn.parallel.DistributedDataParallel(_Unused())  # one each: the error leaves DDP's reducer mid-reduction
    finally:
        dist.destroy_process_group()


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


def test_ddps_unused_parameter_error_reaches_the_runner_and_the_probe_unchanged(unused_ddp):
    model = unused_ddp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=8, micro_batch=8, progress=False, log_every=None)
    with pytest.raises(RuntimeError, match=DDP_SAYS):
        runner.fit([torch.randn(8, 8) for _ in range(3)])
    assert runner.step == 1 and runner.result.oom_recoveries == [] and runner.micro_batch == 8  # step 0 kept, no retry
    model = unused_ddp()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, lambda n: torch.randn(n, 8))
    with pytest.raises(RuntimeError, match=DDP_SAYS):
        autobatch.find_max_batch(step, memory_limit="4MiB", steps_per_trial=2, max_batch=64, cache=False)
