"""Under torch.distributed the CLI's first Ctrl-C (or SIGTERM) asks the runner to stop after the
step in progress; the request now carries the signal's name, so the run's ``result.stop_reason``
says "SIGINT" where it said only "request_stop()"."""

from __future__ import annotations

import signal

import torch

import autobatch
from autobatch.cli.interrupt import Interrupts


def test_a_deferred_signal_names_itself_as_the_runs_stop_reason():
    model = torch.nn.Linear(4, 1)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: m(b).pow(2).mean(), micro_batch=2, global_batch=2, device="cpu")
    interrupts = Interrupts(defer=runner.request_stop)
    with interrupts:
        interrupts._handle(signal.SIGINT, None)  # as the signal would, without sending one to the test process
    result = runner.fit([torch.randn(2, 4) for _ in range(3)], epochs=1)
    assert result.stopped and result.stop_reason == "SIGINT" and result.steps == 1


def test_review31_an_oom_given_up_on_every_rank_is_saved_under_torchrun(monkeypatch):
    """Under torchrun an OOM the runner could not recover from (the recovery's vote ends that step on
    every rank) was raised without a save: 2 ranks lost every step of the run (measured with
    ``train.inject_oom_ranks=[1]``, ``inject_oom_times=null``). The ranks now agree that each gave up
    at the same step, then save as one process does; ranks that did not all stop there save nothing."""
    from autobatch.cli import interrupt
    from autobatch.errors import RankDisagreementError, StepOutOfMemoryError

    asked = []

    def exchange(values, label):
        asked.append(values[0])
        return [list(values), [3, 1]]  # rank 1 gave up at step 3 too (and may save)

    monkeypatch.setattr(interrupt.dist_sync, "exchange", exchange)
    assert interrupt.gave_up_together(StepOutOfMemoryError(3, "backward", False)) and asked == [3]
    assert not interrupt.gave_up_together(StepOutOfMemoryError(4, "backward", False))  # rank 1 at another step
    assert not interrupt.gave_up_together(ValueError("a bug")) and asked == [3, 4]  # other errors: no sync point

    def elsewhere(values, label):
        raise RankDisagreementError(0, label, {1: "#9 runner step 4: gradients ready"}, "the ranks reached different sync points")

    monkeypatch.setattr(interrupt.dist_sync, "exchange", elsewhere)
    error = StepOutOfMemoryError(3, "scheduler", False)
    assert not interrupt.gave_up_together(error) and "not saved" in error.__notes__[0]
