"""Review 8 of the command line, as a demanding user: each test is a bug a user hit.

* ``train``'s probe in a child process (``probe.isolate``, the default on CUDA) that failed
  printed two ``autobatch: error:`` lines (the child's, then "the probe's child process failed
  ...; its error is above"), and a sweep's summary listed only the second, never the real error.
* A ``train`` run that failed mid-run with an error other than an out-of-memory one (a sample
  the dataset cannot read at step 900) lost every step since the last checkpoint (the whole run
  with the default ``train.checkpoint_every=0``) and left a run directory nothing could continue.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from autobatch.__main__ import main
from autobatch.cli import loss as cli_loss  # the default loss the workload's step and the runner take
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint

from conftest import cli_env

BROKEN = '''
import torch


class Broken(torch.nn.Module):
    """A user's model with a bug in forward."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 10)

    def forward(self, x):
        raise KeyError("bug in my model")
'''


def _user_env(tmp_path: Path) -> dict[str, str]:
    """The CLI's environment with ``tmp_path`` (the user's own module) on ``PYTHONPATH``."""
    (tmp_path / "mymodels.py").write_text(BROKEN)
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(tmp_path)])
    return env


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("autobatch: error:")]


ISOLATED = ["probe.isolate=true", "device=cpu", "model=target", "model._target_=mymodels.Broken", "data.shape=[16]",
            "probe.memory_limit=2MiB", "train.steps=2"]  # fmt: skip


def test_a_failed_isolated_probe_is_one_line_naming_the_childs_error(cli_here, monkeypatch, tmp_path):
    """The parent is ``main`` in this process; the probe is a real child process."""
    monkeypatch.setenv("PYTHONPATH", _user_env(tmp_path)["PYTHONPATH"])  # the child imports the user's module
    done = cli_here("train", *ISOLATED)
    assert done.returncode == 1, done.stderr
    (line,) = _errors(done.stderr)  # the type, the message, then where the user's code raised it
    assert line.startswith("autobatch: error: KeyError: 'bug in my model' (raised at ") and "mymodels.py:" in line, done.stderr
    assert "Traceback" not in done.stderr


def test_a_sweeps_summary_names_the_isolated_probes_real_error(cli_here, tmp_path, monkeypatch):
    """The sweep runs through ``main`` in this process; each job's probe is a real child process."""
    sweep = tmp_path / "sweep"
    monkeypatch.setenv("PYTHONPATH", _user_env(tmp_path)["PYTHONPATH"])  # the child imports the user's module
    done = cli_here("train", "-m", *ISOLATED, f"hydra.sweep.dir={sweep}", dirs=False)
    assert done.returncode == 1, done.stderr
    with open(sweep / "summary.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["status"] == "failed" and row["error"].startswith("KeyError: 'bug in my model' (raised at ")
    [line] = _errors(done.stderr)  # the job named, as a sweep's failed job is (the row holds the error alone)
    assert line.startswith("autobatch: error: job 0 (") and line.endswith("): " + row["error"]), done.stderr


#: global batch 16 = 2 micro-batches of 8, five steps, no periodic checkpoint (the default)
RUN = ["model=mlp", "data.shape=[16]", "model.width=32", "data.num_samples=64", "train.global_batch=16",
       "train.micro_batch=8", "train.steps=5", "train.grow_after=0"]  # fmt: skip


@pytest.fixture
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)


def _fail_at(monkeypatch, call: int) -> None:
    """The loss raises a ``RuntimeError`` (not an OOM) at its ``call``-th call (1-based), once."""
    original, calls = cli_loss.cross_entropy_loss, [0]

    def loss(model, batch):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("bad sample in my data")
        return original(model, batch)

    monkeypatch.setattr(cli_loss, "cross_entropy_loss", loss)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("_in_tmp")
def test_an_error_mid_run_saves_the_steps_before_it_and_names_how_to_continue(tmp_path, monkeypatch, capsys):
    _fail_at(monkeypatch, call=6)  # step 3's second micro-batch: steps 1 and 2 done, step 3 half-done
    run = tmp_path / "run"
    assert main(["train", *RUN, f"hydra.run.dir={run}"]) == 1
    err = capsys.readouterr().err
    (line,) = _errors(err)
    assert line.startswith("autobatch: error: RuntimeError: bad sample in my data (raised at ")
    assert "in loss; AUTOBATCH_TRACEBACK=1 for the traceback); the steps before it are saved, step 2" in line
    assert "Traceback" not in err
    assert load_checkpoint(run / "checkpoints")["step"] == 2 and _steps(run) == [1, 2]  # the half step undone
    words = shlex.split(line.split("continue with: ", 1)[1])
    assert words[:3] == ["python", "-m", "autobatch"] and "train.resume=latest" in words
    assert main(words[3:]) == 0  # the loss raises once: the run continues in place to step 5
    assert _steps(run) == [1, 2, 3, 4, 5] and load_checkpoint(run / "checkpoints")["step"] == 5


@pytest.mark.usefixtures("_in_tmp")
def test_an_error_before_the_first_step_is_reported_as_it_is(tmp_path, monkeypatch, capsys):
    _fail_at(monkeypatch, call=1)
    run = tmp_path / "run"
    assert main(["train", *RUN, f"hydra.run.dir={run}"]) == 1
    (line,) = _errors(capsys.readouterr().err)
    assert line.startswith(f"autobatch: error: RuntimeError: bad sample in my data (raised at {__file__}:")
    assert line.endswith(", in loss; AUTOBATCH_TRACEBACK=1 for the traceback)")
    assert not (run / "checkpoints").exists()



@pytest.mark.usefixtures("_in_tmp")
@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_a_probe_cache_dir_that_is_a_file_is_one_error(tmp_path, capsys, where):
    """Before, the probe went on with two warnings blaming the entries and cached nothing."""
    (tmp_path / "afile").write_text("not a directory")
    assert main(["probe", "model=mlp", "data.shape=[16]", f"probe.cache_dir={where}"]) == 2
    err = capsys.readouterr().err
    assert _errors(err) == [f"autobatch: error: probe.cache_dir={where} "
                            + ("is a file" if where == "afile" else "is under a file, afile")
                            + ", not a directory; give a directory for the probe cache (it is made if missing), "
                              "or probe.cache=false"], err


@pytest.mark.usefixtures("_in_tmp")
def test_train_afresh_never_overwrites_a_probes_result(tmp_path, capsys):
    """``probe`` is refused over a training run's directory; ``train`` went the other way and
    overwrote the probe's ``result.json`` with another model's, leaving its ``plan.json`` beside it."""
    run, small = tmp_path / "run", ["data.shape=[16]", "model.width=32", "probe.max_batch=64", "probe.steps_per_trial=1"]
    assert main(["probe", "model=mlp", *small, "train.global_batch=32", f"hydra.run.dir={run}"]) == 0
    kept = {name: (run / name).read_bytes() for name in ("result.json", "plan.json")}
    capsys.readouterr()
    assert main(["train", "model=cnn", "data.shape=[3,8,8]", "train.steps=1", f"hydra.run.dir={run}"]) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert f"{run} holds a probe's result" in line and "give the training run its own hydra.run.dir" in line
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert not (run / "metrics.jsonl").exists()


def test_a_sweep_under_hydra_job_chdir_writes_and_prints_its_summary(cli_here, tmp_path):
    """Each job runs in its own directory there: the rows were looked for under it, the summary
    never written and the table never printed."""
    args = ["model=mlp", "data.shape=[16]", "model.width=32", "probe.max_batch=64", "probe.steps_per_trial=1"]
    done = cli_here("probe", "-m", *args, "probe.multiple_of=1,2", "hydra.job.chdir=true", "hydra.sweep.dir=sweep",
                    dirs=False)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "sweep" / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "ok"), ("1", "ok")]
    assert "2 jobs, 0 failed; summary: sweep/summary.md" in done.stdout


def test_an_interrupted_probe_child_leaves_the_one_line_to_its_parent(monkeypatch, capsys):
    """Ctrl-C reaches ``train``'s probe child and its parent alike (one process group): both
    said ``autobatch: error: interrupted``. The child (``AUTOBATCH_ERROR_FILE`` set) now exits
    130 silently, and the parent says it once."""
    import autobatch.cli.commands as commands
    from autobatch.__main__ import main
    from autobatch.cli.errors import ERROR_FILE_ENV

    def interrupted(command):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "run_app", interrupted)
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    monkeypatch.setenv(ERROR_FILE_ENV, "unused.json")
    assert main(["probe", "model=mlp"]) == 130
    assert "interrupted" not in capsys.readouterr().err
    monkeypatch.delenv(ERROR_FILE_ENV)
    assert main(["probe", "model=mlp"]) == 130
    assert capsys.readouterr().err.count("autobatch: error: interrupted") == 1
