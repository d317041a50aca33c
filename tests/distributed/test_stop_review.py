"""Two CPU ranks (gloo): stop requests at the awkward moments of a distributed run.

Rank 1 alone asks (as a signal that reached one rank would), and every rank must end after the
same step with the same ``result.stopped``:

* inside the run's last step (carried by that step's vote): the run is complete, so no rank
  reports an early stop (before, both said ``stopped``, and the command line under ``torchrun``
  exited 130 without the final weights, printing a continue command with nothing to train);
  one asked in the last step's hook rides on the final checkpoint's sync point and is forgotten;
* inside a step that rank 0 replays after an out-of-memory error (the recovery's sync points),
  plain and FSDP2: both end after that step, and a resume matches the run with the same OOM;
* with data that has no length (a sync point before every step), mid-epoch and at an epoch's
  last batch; with sized data at an epoch's last batch; before a planned run (``micro_batch=None``:
  the plan's sync points carry it); and a second ``fit()`` after a stopped one, which trains on
  to the uninterrupted run's weights.

And ``python -m autobatch train`` under ``torchrun`` with a SIGTERM to rank 1 as the run's last
step starts: the run is complete, so it ends as a finished run (exit 0, ``final_model.pt``).

One launch of ``stop_review_worker.py`` for all of them and ``test_stop_ranks.py``'s (``launcher.stop_runs``).
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from launcher import stop_runs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return stop_runs(tmp_path_factory)


def _same_on_every_rank(reports: list[dict]) -> dict:
    assert all(report == reports[0] for report in reports), reports
    return reports[0]


@pytest.mark.parametrize("where", ["last_step_in_forward", "last_step_in_hook"])
def test_a_request_in_the_last_step_is_no_early_stop_on_any_rank(runs, where):
    report = _same_on_every_rank(runs[where])
    assert report["steps"] == 4 and report["stopped"] is False, report
    assert report["again"] == {"stopped": False, "steps": 8, "epochs": 1, "position": 0, "recoveries": 0}, report


@pytest.mark.parametrize("scenario, steps, epochs, recoveries", [
    ("unsized", 4, 0, 0), ("unsized_epoch_end", 8, 0, 0), ("epoch_end", 8, 1, 0), ("oom_replay", 4, 0, 1),
    ("fsdp_oom", 4, 0, 1),
])
def test_every_rank_ends_after_the_same_step_and_resumes_exactly(runs, scenario, steps, epochs, recoveries):
    report = _same_on_every_rank(runs[scenario])
    assert report["stopped"] is True and report["steps"] == steps and report["epochs"] == epochs, report
    assert report["recoveries"] == recoveries and report["resumed_steps"] == 16 and report["same_weights"], report


def test_a_request_before_a_planned_run_ends_it_after_its_first_step(runs):
    report = _same_on_every_rank(runs["planned"])
    assert report["stopped"] is True and report["steps"] == 1, report


def test_a_second_fit_after_a_stop_trains_on_to_the_uninterrupted_weights(runs):
    report = _same_on_every_rank(runs["second_fit"])
    assert report["stopped"] is True and report["steps"] == 4, report
    assert report["again"]["stopped"] is False and report["again"]["steps"] == 16 and report["same_weights"], report


LAST = 6  # the torchrun run's steps


def test_a_signal_in_the_last_step_under_torchrun_lets_the_run_finish(tmp_path):
    """SIGTERM to rank 1 while the run's last step starts: every rank finishes it, writes the
    final weights and exits 0. Before, both ranks exited 143 with "interrupted at step 6" and a
    continue command that refused to run (the checkpoint was already at ``train.steps``)."""
    from test_cli_stop import COMMON, DATA, MICRO, SLOW, _after_steps, _launch, _worker_pids, metrics_of

    run = tmp_path / "run"
    proc = _launch(*COMMON, *MICRO, *DATA["synthetic"], *SLOW, f"train.steps={LAST}", f"hydra.run.dir={run}",
                   cwd=tmp_path)
    _after_steps(run, proc, LAST - 1)  # rank 0 is in step 5's hook (0.25 s), rank 1 there or before step 6's vote
    pids = _worker_pids(proc)
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the run did not end (a hang)")
    assert proc.returncode == 0 and "interrupted" not in err, err[-3000:]
    assert (run / "final_model.pt").is_file()
    assert [line["step"] for line in metrics_of(run)] == list(range(1, LAST + 1))
