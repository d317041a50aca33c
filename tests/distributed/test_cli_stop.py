"""``python -m autobatch train`` under torchrun, stopped by a signal: every rank ends after the same
step, the checkpoint holds it, and the printed command continues the run to the weights of one
that was never stopped.

* Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it; torchrun then passes
  it on to its ranks again): both ranks finish the step in progress, write the checkpoint
  together and exit 130; rank 0 prints one line naming the checkpoint and the continue command.
* SIGTERM to rank 1's process alone (a signal that reached one rank): rank 0 stops after the
  same step, and both exit 143.

Before, a distributed run stopped where it was, with nothing saved since its last
``train.checkpoint_every``. Each launch has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import launcher
from conftest import cli_in_process
from test_distributed_train import COMMON, DATA, MICRO, assert_same_weights, env, metrics_of

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

STEPS = 24
SLOW = ["train.inject_delay=0.25"]  # time to send the signal mid-run


def _launch(*args: str, cwd: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(launcher.free_port()), "-m", "autobatch", "train", *args]
    return subprocess.Popen(command, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a terminal's Ctrl-C reaches all of it


def _after_steps(run: Path, proc: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + launcher.TIMEOUT_S
    while not (run / "metrics.jsonl").is_file() or len(metrics_of(run)) < steps:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not reach its steps"
        time.sleep(0.05)


def _worker_pids(proc: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return sorted(int(pid) for pid in found)


def _stopped(tmp_path: Path, send) -> tuple[Path, str, int]:
    run = tmp_path / "run"
    proc = _launch(*COMMON, *MICRO, *DATA["synthetic"], *SLOW, f"train.steps={STEPS}", f"hydra.run.dir={run}",
                   cwd=tmp_path)
    _after_steps(run, proc, 3)
    send(proc)
    try:
        out, err = proc.communicate(timeout=launcher.TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the stopped run did not end (a hang)")
    state = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    steps = [line["step"] for line in metrics_of(run)]
    assert 3 <= state["step"] < STEPS and steps == list(range(1, state["step"] + 1)), (state["step"], steps, err)
    assert not (run / "final_model.pt").exists()
    return run, err, state["step"]


def _continued(tmp_path: Path, err: str, run: Path, reference) -> None:
    line = next(text for text in err.splitlines() if "on every rank; checkpoint" in text)
    words = shlex.split(line.split("continue with: ", 1)[1])
    assert words[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "autobatch"] and words[5] == "train"
    assert SLOW[0] in words  # the printed command is the run's own; it continues here without the delay
    done = launcher.torchrun(*words[5:], "train.inject_delay=0", cwd=tmp_path, env=env(), timeout=launcher.TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line["step"] for line in metrics_of(run)] == list(range(1, STEPS + 1))
    assert_same_weights(run, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process training the same global batches (as ``test_distributed_train`` compares)."""
    base = tmp_path_factory.mktemp("reference")
    # in this process: a subprocess would only add ~4 s of imports to what is compared
    assert cli_in_process("train", *COMMON, *MICRO, *DATA["synthetic"], f"train.steps={STEPS}", f"hydra.run.dir={base / 'run'}",
                          cwd=base) == 0
    return base / "run"


def test_ctrl_c_under_torchrun_saves_every_ranks_step_and_the_printed_command_continues(tmp_path, reference):
    run, err, step = _stopped(tmp_path, lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert err.count(f"autobatch: interrupted (SIGINT) at step {step} on every rank; checkpoint") == 1, err[-3000:]
    _continued(tmp_path, err, run, reference)


def test_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path, reference):
    def to_rank_one(proc):
        pids = _worker_pids(proc)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGTERM)

    run, err, step = _stopped(tmp_path, to_rank_one)
    assert f"autobatch: interrupted (SIGTERM) at step {step} on every rank" in err, err[-3000:]
    assert "exitcode  : 143" in err, err[-3000:]  # (torchrun may end the other rank with SIGTERM once one exited)
