"""A ``Runner`` built before ``torch.distributed.init_process_group()`` (one process, no launch).

``Runner(distributed=None)`` decides at its construction whether it trains across ranks. Built
before the script made its process group (a common order: build everything, then call
``init_process_group()`` right before ``fit()``), it chose one process, and ``fit()`` under a
group of 2 gloo ranks trained each rank alone: no sync point, no all-reduce, each rank's batch
trained as a whole global batch with only a batch-size warning, and the ranks' weights came
apart silently. Now ``fit()`` raises one ``ValueError`` naming the order to use before any step
(``autobatch.training.ranks.BuiltAlone``); ``distributed=False`` still trains each rank alone on
purpose, and a group of one rank (``torchrun --nproc-per-node 1``) is still one process. The job
of 2 ranks is simulated as in ``test_review20_world_change.py``: no second process is needed to
see that the runner would not talk to it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autobatch import Runner
from autobatch.dist import agreement

from runner_workloads import FEATURES, make_data, mse

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def _runner(**options) -> tuple[Runner, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1).double()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=4,
                    grow_after=None, progress=False, log_every=None, **options)
    return runner, model


def _as_rank_of_two(monkeypatch) -> None:
    """From here on, this process is rank 0 of a job of 2 ranks (init_process_group() was called)."""
    monkeypatch.setattr(agreement, "world_size", lambda: 2)
    monkeypatch.setattr(agreement, "is_distributed", lambda: True)


def test_fit_in_a_group_made_after_the_runner_is_one_clear_error(monkeypatch):
    runner, model = _runner()
    assert not runner.distributed
    _as_rank_of_two(monkeypatch)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"built before torch\.distributed\.init_process_group\(\).* 2 ranks.*"
                                         r"Build the Runner after init_process_group\(\).*distributed=False"):
        runner.fit([(x[:8], y[:8]) for x, y, _ in make_data(32, 16)])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # before: trained alone, weights apart


def test_distributed_false_still_trains_each_rank_alone_in_a_group(monkeypatch):
    runner, _ = _runner(distributed=False)
    _as_rank_of_two(monkeypatch)
    assert runner.fit(make_data(32, 16)).steps == 2


def test_a_one_rank_group_made_after_the_runner_trains_in_one_process():
    runner, _ = _runner()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert runner.fit(make_data(32, 16)).steps == 2
    finally:
        dist.destroy_process_group()


def test_a_distributed_runner_built_before_the_group_is_refused_before_any_sync_point(monkeypatch):
    """``Runner(distributed=True)`` before ``init_process_group()`` kept the share of one process
    (the whole global batch); its ``fit()`` in the group reached the fit-arguments sync point first."""
    runner, _ = _runner(distributed=True)
    assert runner.distributed and runner.share == 16
    _as_rank_of_two(monkeypatch)
    monkeypatch.setattr(agreement, "exchange", lambda *a, **k: pytest.fail("a sync point in a world it was not built in"))
    with pytest.raises(ValueError, match=r"built in one process \(before init_process_group\(\)\) and fit\(\) now runs "
                                         r"in a job of 2 ranks.*build a new Runner"):
        runner.fit(make_data(32, 16))


def test_review37_torchrun_without_a_group_is_one_clear_error(monkeypatch, tmp_path):
    """Under ``torchrun --nproc-per-node 2`` a script that never called ``init_process_group()``
    (no group at all, ``WORLD_SIZE=2`` in the environment) trained the whole global batch on every
    rank alone, each rank writing the same checkpoint files, with no word; now ``fit()`` names the
    call to make before any step. ``distributed=False`` still trains each rank alone on purpose."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    runner, model = _runner(checkpoint_dir=tmp_path, checkpoint_every=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"one of 2 ranks \(WORLD_SIZE=2.*no process group was made.*"
                                         r"init_process_group\(\).*distributed=False"):
        runner.fit(make_data(32, 16))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not any(tmp_path.iterdir())
    assert _runner(distributed=False)[0].fit(make_data(32, 16)).steps == 2
