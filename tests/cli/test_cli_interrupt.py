"""A ``train`` run stopped by Ctrl-C, SIGTERM or an out-of-memory error it cannot recover from
saves its progress, names the command that continues it, and exits 130 / 143 / 1; and
``train.resume=latest`` never silently continues an older run than the newest.

The runs are in-process (``autobatch.__main__.main``) and tiny; the signal is sent to this
process from inside the loss of a chosen step's second micro-batch, so it lands mid-step, where
the runner must undo the half-done step before the checkpoint is written.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from autobatch.__main__ import main
from autobatch.cli import loss as cli_loss  # the default loss the workload's step and the runner take
from autobatch.cli.training import find_resume
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint

#: global batch 16 = 2 micro-batches of 8: a signal in the second one stops a step half-done
RUN = ["model=mlp", "data.shape=[16]", "model.width=32", "data.num_samples=64", "train.global_batch=16",
       "train.micro_batch=8", "train.steps=5", "train.grow_after=0"]  # fmt: skip


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    # a test run started in the background (`pytest &`, no job control) inherits SIGINT ignored,
    # which the CLI rightly leaves ignored (a nohup run's): these tests need it to arrive
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _signal_at(monkeypatch, signum: int, call: int) -> None:
    """Send ``signum`` to this process from the loss's ``call``-th call (1-based), once."""
    original, calls = cli_loss.cross_entropy_loss, [0]

    def loss(model, batch):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signum)
        return original(model, batch)

    monkeypatch.setattr(cli_loss, "cross_entropy_loss", loss)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _continue_args(err: str) -> list[str]:
    command = err.split("continue with: ", 1)[1].strip()
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "autobatch"]
    return words[3:]


@pytest.mark.parametrize("signum, code, every", [(signal.SIGTERM, 143, 0), (signal.SIGINT, 130, 2)])
def test_an_interrupted_run_saves_its_steps_and_continues_to_the_uninterrupted_weights(
    tmp_path, monkeypatch, capsys, signum, code, every
):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    _signal_at(monkeypatch, signum, call=6)  # step 3's second micro-batch: steps 1 and 2 done
    run = tmp_path / "run"
    assert main(["train", *RUN, f"train.checkpoint_every={every}", f"hydra.run.dir={run}"]) == code
    err = capsys.readouterr().err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers put back
    lines = [line for line in err.splitlines() if line.startswith("autobatch:")]
    assert len(lines) == 1 and f"interrupted ({signal.Signals(signum).name}) at step 2" in lines[0], err
    assert "Traceback" not in err
    assert load_checkpoint(run / "checkpoints")["step"] == 2 and _steps(run) == [1, 2]  # the half step undone
    args = _continue_args(lines[0])  # the loss sends no second signal: its call count is past it
    assert "train.resume=latest" in args and f"hydra.run.dir={run}" in args
    assert main(args) == 0
    assert _steps(run) == [1, 2, 3, 4, 5]
    assert main(["train", *RUN, f"hydra.run.dir={tmp_path / 'whole'}"]) == 0
    resumed = torch.load(run / "final_model.pt", weights_only=True)
    whole = torch.load(tmp_path / "whole" / "final_model.pt", weights_only=True)
    assert all(torch.equal(resumed[name], whole[name]) for name in whole)


def test_an_unrecoverable_oom_saves_the_steps_before_it(tmp_path, capsys):
    run = tmp_path / "run"
    args = [*RUN[:4], "train.global_batch=4", "train.micro_batch=2", "train.inject_oom=[[2,forward]]",
            "train.inject_oom_times=null", f"hydra.run.dir={run}"]  # fmt: skip
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autobatch: error: global step 2 ran out of memory") and err.count("\n") == 1, err
    assert "; the steps before it are saved, step 2: checkpoint " in err and f"hydra.run.dir={run}" in err
    assert load_checkpoint(run / "checkpoints")["step"] == 2 and _steps(run) == [1, 2]


def _checkpoint(path: Path, age: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_latest_refuses_an_older_runs_checkpoint_when_the_newest_run_has_none(tmp_path):
    old = _checkpoint(tmp_path / "outputs/train/day/10-00-00/checkpoints/last.pt", age=100)
    newer = tmp_path / "outputs/train/day/11-00-00"
    newer.mkdir(parents=True)
    (newer / "metrics.jsonl").write_text('{"step": 1}\n')  # it trained, then was killed before any save
    with pytest.raises(ValueError, match=f"newest run, {newer}, has no checkpoint.*train.resume={old}"):
        find_resume("latest", "checkpoints", tmp_path)
    (newer / "metrics.jsonl").write_text("")  # failed before its first update: nothing of it to continue
    assert find_resume("latest", "checkpoints", tmp_path) == old
    assert find_resume(str(old), "checkpoints", tmp_path) == old  # the explicit path always works



def test_review34_a_given_up_step_saves_its_checkpoint_once(tmp_path, monkeypatch):
    """The runner saves the steps trained as it gives up on a step; the command line's stop
    (autobatch.cli.interrupt.stopped) saved the same state again, and now names the runner's file."""
    from autobatch.cli import interrupt
    from autobatch.cli.errors import CLIError
    from autobatch.errors import StepOutOfMemoryError
    from autobatch.training.oom.faults import FaultInjector
    from autobatch.training.runner import Runner

    saves, save = [], Runner.save
    monkeypatch.setattr(Runner, "save", lambda self, *a, **k: saves.append(self.step) or save(self, *a, **k))
    monkeypatch.setattr(interrupt, "continue_command", lambda out_dir: "python -m autobatch train train.resume=latest")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, batch: m(batch).sum(), global_batch=2,
                    micro_batch=1, checkpoint_dir=tmp_path / "checkpoints", faults=FaultInjector([(1, "forward")], times=None))
    with pytest.raises(StepOutOfMemoryError) as gave_up:
        runner.fit([torch.randn(2, 4) for _ in range(3)], steps=3)
    with open(os.devnull, "w") as metrics, pytest.raises(CLIError) as raised:
        interrupt.stopped(gave_up.value, runner, interrupt.Interrupts(enabled=False), out_dir=tmp_path, logged=1,
                          metrics=metrics, resume=None)
    assert saves == [1], saves  # the runner's, at the step given up: not a second one
    assert f"the steps before it are saved, step 1: checkpoint {tmp_path / 'checkpoints' / 'last.pt'};" in raised.value.message
    assert load_checkpoint(tmp_path / "checkpoints")["step"] == 1
