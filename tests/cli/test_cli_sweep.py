"""Multirun sweeps: every combination runs; summary.csv and summary.md list each job."""

from __future__ import annotations

import csv

import pytest

from conftest import SMALL

from autobatch.cli.sweep import COLUMNS, render_markdown


def _rows(sweep):
    with open(sweep / "summary.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_sweep_runs_every_combination_and_summarises(cli_here, tmp_path):
    done = cli_here("probe", "-m", "model=mlp,gpt", "probe.strategy=binary,halving", *SMALL)
    assert done.returncode == 0, done.stderr
    sweep = tmp_path / "sweep"
    rows = _rows(sweep)
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    assert {(r["overrides"].split()[0], r["overrides"].split()[1]) for r in rows} == {
        (f"model={m}", f"probe.strategy={s}") for m in ("mlp", "gpt") for s in ("binary", "halving")
    }
    assert all(r["status"] == "ok" and int(r["batch_size"]) == 64 and r["peak"].endswith("B") for r in rows)
    assert list(rows[0])[: len(COLUMNS) - 1] == list(COLUMNS[:-1])
    markdown = (sweep / "summary.md").read_text()
    shared, table = markdown.split("\n\n", 1)  # the overrides every job shares, once, above the table
    assert shared.startswith("overrides of every job: data.shape=[16]") and "model=" not in shared
    assert table.startswith("| job | overrides | status | batch_size | trials | peak | time_s |")
    assert table.count("\n") == 2 + 4 and "| 3 | model=gpt probe.strategy=halving |" in table
    assert markdown in done.stdout  # the table is printed at the end too
    assert all((sweep / str(job) / "result.json").is_file() for job in range(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def test_failed_jobs_are_rows_too_and_the_exit_status_says_so(cli_here, tmp_path):
    done = cli_here("probe", "-m", "model=gpt", "probe.memory_limit=256KiB,64MiB", *SMALL)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    # the line names its job: Hydra prints it alone, before the table (review 21)
    assert "autobatch: error: job 0 (model=gpt probe.memory_limit=256KiB data.shape=[16] " in done.stderr
    assert "): No batch size fits" in done.stderr
    # the table and one error line; not Hydra's own lines (its HYDRA_FULL_ERROR hint: AUTOBATCH_TRACEBACK=1 here)
    assert "HYDRA_FULL_ERROR" not in done.stderr and "Error executing job" not in done.stderr, done.stderr
    assert done.stderr.count("autobatch: error: ") == 1 and "| failed |" in done.stdout
    rows = _rows(tmp_path / "sweep")
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "ok")]
    assert rows[0]["error"].startswith("No batch size fits") and rows[0]["batch_size"] == ""
    assert "| failed |" in (tmp_path / "sweep" / "summary.md").read_text()


def test_train_sweep_adds_its_columns(cli_here, tmp_path):
    done = cli_here("train", "-m", "optimizer=adamw,sgd", "model=mlp", "train.micro_batch=8", "train.steps=2", *SMALL[:3])
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["steps"] == "2" and rows[0]["batch_size"] == "8" and rows[0]["final_loss"]


def test_markdown_escapes_pipes_and_shortens_errors():
    rows = [{"job": 0, "overrides": "a=1", "status": "failed", "error": "Nothing fits. " + "x" * 300 + " | y"}]
    line = render_markdown(rows).splitlines()[-1]
    assert line.endswith("| Nothing fits |")


def test_joblib_launcher_sweep_is_summarised_across_processes(cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=gpt", "probe.memory_limit=256KiB,64MiB"]
    done = cli("probe", *args, *SMALL)
    assert done.returncode == 1
    assert done.stderr.count("autobatch: error: ") == 1
    rows = _rows(tmp_path / "sweep")
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "ok")]


def test_only_rank_zero_writes_sweep_rows_and_summaries(tmp_path, monkeypatch):
    """Under torchrun every rank runs the sweep's jobs; ranks above 0 write nothing."""
    from types import SimpleNamespace

    from hydra.types import RunMode

    from autobatch.cli.sweep import SweepSummary

    monkeypatch.setenv("RANK", "1")  # before the process group exists, RANK decides
    config = SimpleNamespace(hydra=SimpleNamespace(mode=RunMode.MULTIRUN, sweep=SimpleNamespace(dir=str(tmp_path))))
    callback = SweepSummary()
    callback.on_job_end(config, job_return=None)
    callback.on_multirun_end(config)
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_into_an_earlier_sweeps_directory_lists_only_its_own_jobs(cli_here, tmp_path):
    """``hydra.sweep.dir`` given again: the earlier sweep's rows (jobs 2 and 3) stay on disk but
    are not this sweep's, so the summary leaves them out."""
    done = cli_here("probe", "-m", "model=mlp", "probe.strategy=binary,halving,power,auto", *SMALL)
    assert done.returncode == 0, done.stderr
    done = cli_here("probe", "-m", "model=gpt", "probe.strategy=binary,halving", *SMALL)
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path / "sweep")
    assert [(r["job"], r["overrides"].split()[0]) for r in rows] == [("0", "model=gpt"), ("1", "model=gpt")]
    assert "2 jobs, 0 failed" in done.stdout
    assert (tmp_path / "sweep" / "3" / "summary_row.json").is_file()  # the earlier sweep's files are kept


def test_resume_latest_in_a_sweep_is_each_jobs_own_checkpoint(cli_here, tmp_path):
    """A sweep continued in its own directory resumes each job from its own checkpoint; a sweep
    whose jobs have none is refused, each job with one line (it used to resume every job from
    the newest checkpoint, an earlier job's of the same sweep, and train nothing)."""
    args = ("model=mlp", "train.micro_batch=8", *SMALL[:3], "optimizer.lr=0.001,0.01")
    first = tmp_path / "multirun" / "train" / "first"
    done = cli_here("train", "-m", "train.steps=2", *args, f"hydra.sweep.dir={first}", dirs=False)
    assert done.returncode == 0, done.stderr
    done = cli_here("train", "-m", "train.steps=4", "train.resume=latest", *args, f"hydra.sweep.dir={first}", dirs=False)
    assert done.returncode == 0, done.stderr
    assert [r["steps"] for r in _rows(first)] == ["4", "4"]
    done = cli_here("train", "-m", "train.steps=6", "train.resume=latest", *args,
                   f"hydra.sweep.dir={tmp_path / 'multirun' / 'train' / 'second'}", dirs=False)
    assert done.returncode == 1
    assert "train.resume=latest in a sweep (-m) resumes each job from its own run directory" in done.stderr
    assert [r["status"] for r in _rows(tmp_path / "multirun" / "train" / "second")] == ["failed", "failed"]
