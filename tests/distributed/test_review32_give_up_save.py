"""A distributed ``Runner`` that gives up on an OOM at every rank saves the steps before it.

Found by reading: the one-process runner writes the steps trained to ``checkpoint_dir`` before it
raises ``StepOutOfMemoryError``, and the command line did so under ``torchrun``
(``autobatch.cli.interrupt.gave_up_together``), but the library's runner under DDP or FSDP2 saved
nothing, so a user's run lost every step since its last ``checkpoint_every`` (the whole run
without it). Now every rank that gave up meets at one sync point (``every rank gave up on the same
step``) and, where they all stopped at the same step, they save together. A one-rank gloo group
stands in for two ranks: the sync point's second row is a peer's, made up here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autobatch
from autobatch import FaultInjector, StepOutOfMemoryError
from autobatch.cli import interrupt
from autobatch.training.checkpoints.give_up import GAVE_UP
from one_rank import one_rank_group  # noqa: F401  (a fixture)
from runner_workloads import make_data, make_model, mse

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def _give_up(monkeypatch, tmp_path, peer_step: int) -> tuple[autobatch.Runner, StepOutOfMemoryError, list]:
    """A distributed runner that gives up at step 1 (an OOM at every micro-batch), whose peer gave up
    at ``peer_step``; returns it, its error, and the rows of every give-up sync point."""
    model = make_model()
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                              distributed=True, progress=False, log_every=None, grow_after=None,
                              checkpoint_dir=tmp_path, faults=FaultInjector([(1, "forward")], times=None))
    exchange, seen = runner._parallel.exchange, []

    def two_ranks(values, label):
        rows = exchange(values, label)
        if label == GAVE_UP:
            rows = rows + [[peer_step, 1]]
            seen.append(rows)
        return rows

    monkeypatch.setattr(runner._parallel, "exchange", two_ranks)
    with pytest.raises(StepOutOfMemoryError) as info:
        runner.fit(make_data(), epochs=1)
    return runner, info.value, seen


def test_review32_every_rank_giving_up_saves_the_steps_before_it(one_rank_group, monkeypatch, tmp_path):
    runner, error, seen = _give_up(monkeypatch, tmp_path, peer_step=1)
    assert seen == [[[1, 1], [1, 1]]]  # one sync point: both ranks at step 1, both may save
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "the 1 step trained is saved in" in notes, notes
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["step"] == 1 and runner.result.checkpoints_saved == 1  # the step given up is not in it
    # the command line reads the runner's verdict: no second sync point
    monkeypatch.setattr(interrupt.dist_sync, "exchange", lambda values, label: pytest.fail("a second sync point"))
    assert interrupt.gave_up_together(error)


def test_review32_ranks_that_gave_up_at_different_steps_save_nothing(one_rank_group, monkeypatch, tmp_path):
    runner, error, seen = _give_up(monkeypatch, tmp_path, peer_step=2)
    assert len(seen) == 1
    assert not (tmp_path / "last.pt").exists() and runner.result.checkpoints_saved == 0
    assert "not saved, the ranks gave up at different steps (step 1 here; rank 1 step 2)" in error.__notes__[-1]
    assert not interrupt.gave_up_together(error)
