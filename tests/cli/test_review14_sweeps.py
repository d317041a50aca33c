"""Review 14 of the sweep summary: a sweep into an earlier one's directory drops its summary
files, an interrupted job's continue command survives the printed table, and a raw exception's
row names its type."""

from __future__ import annotations

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from autobatch.cli.sweep import SUMMARY_FILES, SweepSummary, _job_row, render_markdown


def test_a_new_sweep_sets_the_earlier_sweeps_summary_aside(tmp_path):
    """Re-run with ``probe.plot=false`` into the same ``hydra.sweep.dir``, the earlier sweep's
    ``summary.png`` (4 jobs, 2 failed) stayed, and the last line named it as this sweep's: the
    earlier files leave their names (kept as ``summary.earlier-*``, review 39)."""
    for name in SUMMARY_FILES:
        (tmp_path / name).write_text("earlier sweep")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "runtime": {"cwd": str(tmp_path)}}})
    SweepSummary().on_multirun_start(config)
    assert not [name for name in SUMMARY_FILES if (tmp_path / name).exists()]
    assert (tmp_path / ".sweep_id").is_file()


def test_an_interrupted_jobs_continue_command_is_printed_whole():
    """The printed table cut the interrupted job's error at 120 characters, mid-command, while
    the last line said "their rows say how to continue"."""
    command = "python -m autobatch train model=mlp train.steps=100000 train.resume=latest hydra.run.dir=/tmp/sweep/0"
    error = f"interrupted (SIGINT) at step 73; checkpoint /tmp/sweep/0/checkpoints/last.pt; continue with: {command}"
    rows = [{"job": 0, "status": "interrupted", "error": error}, {"job": 1, "status": "failed", "error": "x. " + "y" * 200}]
    table = render_markdown(rows)
    assert command in table
    assert "y" * 130 not in table  # a failed job's error is still its first sentence


def test_a_raw_exceptions_row_names_its_type():
    """Under ``AUTOBATCH_TRACEBACK=1`` a job raises the exception itself: ``KeyError('lr')`` read
    ``'lr'`` in the summary."""
    config = OmegaConf.create({"hydra": {"job": {"num": 3}, "overrides": {"task": ["a=1"]}}})
    job = JobReturn(overrides=["a=1"], status=JobStatus.FAILED, _return_value=KeyError("lr"))
    assert _job_row(config, job) == {"job": 3, "overrides": "a=1", "status": "failed", "error": "KeyError: 'lr'"}
