"""Review 39: a sweep loses none of the files an earlier sweep or another of its jobs wrote.

* ``train -m`` run again into the same ``hydra.sweep.dir`` deleted the earlier sweep's summary when
  it started, then wrote each refused job's ``failed`` row over the completed row of the earlier
  sweep's job: the only summary left was a table of refusals.
* A fixed ``hydra.sweep.subdir`` (``.``) gave several jobs one directory: a ``probe`` job overwrote
  the first one's ``result.json`` and the summary counted one job of two.
* A sweep whose first job was interrupted drew no ``summary.png``, though the docs said it is redrawn.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from autobatch.cli import sweep, sweep_dirs


def _hydra(tmp_path, num=0, job_dir="0"):
    return {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(tmp_path), "subdir": job_dir},
            "runtime": {"cwd": str(tmp_path), "output_dir": str(tmp_path / job_dir)},
            "job": {"num": num, "name": "train"}, "overrides": {"task": ["optimizer=adamw"]}}


def test_review39_a_rerun_keeps_the_earlier_summary_and_completed_rows(tmp_path, monkeypatch):
    (tmp_path / sweep.SWEEP_ID_FILE).write_text("old\n")
    for name in sweep.SUMMARY_FILES:
        (tmp_path / name).write_text(f"earlier {name}")
    (tmp_path / "0").mkdir()
    done = {"job": 0, "overrides": "optimizer=adamw", "status": "ok", "final_loss": 7.1, sweep._SWEEP_KEY: "old"}
    (tmp_path / "0" / sweep.ROW_FILE).write_text(json.dumps(done))
    config = OmegaConf.create({"hydra": _hydra(tmp_path), "probe": {"plot": False}})
    monkeypatch.setattr(sweep, "HydraConfig", SimpleNamespace(get=lambda: config.hydra, initialized=lambda: True))
    callback = sweep.SweepSummary()
    callback.on_multirun_start(config)
    kept = sorted(path.name for path in tmp_path.glob("summary.earlier-*"))
    assert [name.rsplit(".", 1)[1] for name in kept] == ["csv", "md", "png"], "the earlier sweep's summary was deleted"
    assert (tmp_path / kept[1]).read_text() == "earlier summary.md"
    refused = JobReturn(overrides=["optimizer=adamw"], status=JobStatus.FAILED,
                        _return_value=ValueError("/0 already holds a run"))
    callback.on_job_end(config, job_return=refused)
    assert json.loads((tmp_path / "0" / sweep.ROW_FILE).read_text()) == done, "the completed row was overwritten"
    markdown = (tmp_path / "summary.md").read_text()
    assert "| 0 | optimizer=adamw | failed |" in markdown and kept[1] in markdown  # the new summary names the earlier one


def test_review39_a_second_job_in_the_first_jobs_directory_is_refused(tmp_path):
    from autobatch.cli import run_dir

    sweep_dirs.claim_job_dir(tmp_path, "s1", 0, ".")
    (tmp_path / sweep.ROW_FILE).write_text(json.dumps({"job": 0, "status": "ok", sweep._SWEEP_KEY: "s1"}))
    with pytest.raises(ValueError, match=r"job 0 of this sweep already wrote its files into .*hydra.sweep.subdir='\$\{hydra.job.num\}'"):
        sweep_dirs.claim_job_dir(tmp_path, "s1", 1, ".")
    assert sweep_dirs.row_path(tmp_path, {"job": 1, "status": "failed", sweep._SWEEP_KEY: "s1"}).name == "summary_row.job1.json"
    (tmp_path / sweep.SWEEP_ID_FILE).write_text("s1\n")
    config = OmegaConf.create({"hydra": _hydra(tmp_path, num=1, job_dir=".")})
    assert run_dir._held(config, tmp_path) and run_dir._refused(config, tmp_path)  # job 0's .hydra/ and log are kept
    sweep_dirs.claim_job_dir(tmp_path, "s2", 0, ".")  # a later sweep's job 0 claims it again


def test_review39_a_first_interrupted_job_draws_the_sweeps_picture(tmp_path, monkeypatch):
    (tmp_path / sweep.SWEEP_ID_FILE).write_text("s1\n")
    hydra = SimpleNamespace(mode=RunMode.MULTIRUN, sweep=SimpleNamespace(dir=str(tmp_path)),
                            runtime=SimpleNamespace(cwd=None, output_dir=str(tmp_path / "0")),
                            job=SimpleNamespace(num=0, name="probe"))
    monkeypatch.setattr(sweep, "HydraConfig", SimpleNamespace(initialized=lambda: True, get=lambda: hydra))
    monkeypatch.setattr(sweep, "given_overrides", lambda: ["model=cnn"])
    drawn = []
    monkeypatch.setattr(sweep, "_write_plot", lambda where, rows: drawn.append([row["status"] for row in rows]))
    (tmp_path / "0").mkdir()
    sweep.record_interrupted("interrupted (SIGINT) before any step trained, nothing saved; run the job again")
    assert drawn == [["interrupted"]], "no summary.png for a sweep whose first job was interrupted"
