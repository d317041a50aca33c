"""Review 37: what a sweep reports when one of its jobs is stopped.

* A SIGTERM (a scheduler's, a ``kill``) while a ``probe`` sweep's job ran killed the process where
  it was: the job left no row, and the summary listed the jobs before it alone ("1 job, 0
  failed"), where a Ctrl-C leaves an ``interrupted`` row (:mod:`autobatch.cli.job_signals`).
* After a Ctrl-C the job's row was written and the tables rebuilt, but not ``summary.png``: the
  picture the last line names showed the jobs before it alone.
"""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest
from hydra.types import RunMode

from autobatch.cli import errors, sweep


def test_review37_a_sweep_jobs_sigterm_is_an_interrupted_row(monkeypatch):
    recorded = []
    monkeypatch.setattr(sweep, "record_interrupted", recorded.append)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with errors.reported(multirun=True):
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler), "a sweep job's SIGTERM keeps its default action: the job leaves no row"
            handler(signal.SIGTERM, None)
    assert recorded and recorded[0].startswith("interrupted (SIGTERM)")
    assert signal.getsignal(signal.SIGTERM) is before  # put back for the next job


def test_review37_an_interrupted_row_redraws_the_sweeps_picture(tmp_path, monkeypatch):
    (tmp_path / sweep.SWEEP_ID_FILE).write_text("s1\n")
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / sweep.ROW_FILE).write_text(json.dumps({"job": 0, "overrides": "model=mlp", "status": "ok",
                                                             "batch_size": 8, sweep._SWEEP_KEY: "s1"}))
    (tmp_path / sweep.PLOT_FILE).write_bytes(b"job 0 alone")  # drawn when job 0 ended
    hydra = SimpleNamespace(mode=RunMode.MULTIRUN, sweep=SimpleNamespace(dir=str(tmp_path)),
                            runtime=SimpleNamespace(cwd=None, output_dir=str(tmp_path / "1")),
                            job=SimpleNamespace(num=1, name="probe"))
    monkeypatch.setattr(sweep, "HydraConfig", SimpleNamespace(initialized=lambda: True, get=lambda: hydra))
    monkeypatch.setattr(sweep, "given_overrides", lambda: ["model=cnn"])
    drawn = []
    monkeypatch.setattr(sweep, "_write_plot", lambda where, rows: drawn.append([row["status"] for row in rows]))
    (tmp_path / "1").mkdir()
    sweep.record_interrupted("interrupted (SIGINT) before any step trained, nothing saved; run the job again")
    assert drawn == [["ok", "interrupted"]], "summary.png kept showing job 0 alone"
