"""A ``DistributedDataParallel`` model in a one-process group (``torchrun --nproc-per-node 1``,
a DDP script run on one GPU): an out-of-memory error inside backward left DDP's reducer
mid-reduction, and every later forward raised "Expected to have finished reduction in the prior
iteration". The probe stopped at its first OOM trial with that error; the Runner shrank the
micro-batch until the error was blamed on a micro-batch too small to train
(``autobatch.probe.snapshot.ddp_reducer.reset_failed_reduction``). The bucket rebuild each reset asks for
runs at once, between steps, and never in a later forward, where the new buckets came on top of
that step's memory (on one GPU every other step of a size that trained ran out of memory after
one OOM: :mod:`autobatch.probe.snapshot.ddp_reducer`); only DDP's own first rebuild is in a forward. In
process: a one-rank gloo group on a ``HashStore``, destroyed after the test.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autobatch
from autobatch import TrainStep
from conftest import LogLines

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


@pytest.fixture
def one_rank_ddp():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        yield nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                                              nn.Linear(256, 16)))
    finally:
        dist.destroy_process_group()


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


#: what DDP's forward logs when it rebuilt its buckets there
REBUILT_IN_FORWARD = "Reducer buckets have been rebuilt in this iteration"


@pytest.fixture
def ddp_log():
    """DDP's own log lines (its logger does not propagate to the root, where caplog listens)."""
    logger, kept = logging.getLogger("torch.nn.parallel.distributed"), LogLines()
    level = logger.level
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    try:
        yield kept.lines
    finally:
        logger.removeHandler(kept)
        logger.setLevel(level)


def test_the_probe_and_the_runner_recover_a_one_rank_ddp_from_an_oom_in_backward(one_rank_ddp, ddp_log):
    model = one_rank_ddp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, optimizer, loss_fn, lambda n: torch.randn(n, 16))
    found = autobatch.find_max_batch(step, memory_limit="600KiB", steps_per_trial=1, strategy="binary", cache=False)
    assert any(not trial.passed for trial in found.trials) and found.batch_size > 1
    with autobatch.simulated_memory("1800KiB"):  # its first micro-batch runs out of memory in backward
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=512, micro_batch=512, progress=False)
        result = runner.fit([torch.randn(512, 16) for _ in range(2)], epochs=1)
    assert result.steps == 2 and any(r["phase"] == "backward" for r in result.oom_recoveries), result.oom_recoveries
    assert len([m for m in ddp_log if REBUILT_IN_FORWARD in m]) == 1  # DDP's first; each reset's between steps
    assert not model.reducer._rebuild_buckets()  # and none left pending


def test_a_fresh_one_rank_ddp_rebuilds_its_buckets_before_the_runners_first_step(one_rank_ddp, ddp_log):
    """DDP's own first rebuild, in the second step's forward, came after the old buckets' all-reduce,
    whose release came late on a GPU: the rebuild is made before the first step instead."""
    model = one_rank_ddp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=32, micro_batch=32, progress=False)
    assert runner.fit([torch.randn(32, 16) for _ in range(3)], epochs=1).steps == 3
    assert not [m for m in ddp_log if REBUILT_IN_FORWARD in m]
    assert model._has_rebuilt_buckets and not model.reducer._rebuild_buckets()
