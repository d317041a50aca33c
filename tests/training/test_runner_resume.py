"""Checkpoints and resume: atomic writes; a run killed with SIGKILL resumes exactly.

Weights are compared with ``rtol=1e-10, atol=1e-12`` (float64); with the same micro-batch
splits and random numbers the runs are in fact bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import autobatch
from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint, save_checkpoint
from resume_worker import EPOCHS, SAMPLES, TOTAL_STEPS, build
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights

WORKER = Path(__file__).resolve().parents[1] / "resume_worker.py"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runner, loader, on_step_end = build(str(tmp_path_factory.mktemp("reference")))
    result = runner.fit(loader, epochs=EPOCHS, on_step_end=on_step_end)
    assert result.steps == TOTAL_STEPS and len(result.oom_recoveries) == 1
    return weights(runner.model)


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sigkill_and_resume_loses_and_repeats_nothing(tmp_path, uninterrupted):
    ckpt, out, log = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "log.jsonl"
    command = [sys.executable, str(WORKER), str(ckpt), str(out), str(log)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    worker = subprocess.Popen(command + ["--delay", "0.2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(read_log(log)) < 6 and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.poll() is None, f"worker ended before it could be killed: {worker.stdout.read().decode()[-2000:]}"
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=30)
    assert worker.returncode == -signal.SIGKILL and not out.exists()

    killed_at = load_checkpoint(ckpt)["step"]
    before = read_log(log)
    assert 5 <= killed_at < TOTAL_STEPS  # a step's log line (its hook) comes before its checkpoint
    assert [entry["step"] for entry in before] in (list(range(1, killed_at + 1)), list(range(1, killed_at + 2)))
    log.write_text("")
    done = subprocess.run(command + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    after = read_log(log)

    # Every step after the checkpoint ran exactly once; none before it ran again.
    assert [entry["step"] for entry in after] == list(range(killed_at + 1, TOTAL_STEPS + 1))
    applied = {entry["step"]: entry for entry in before[:killed_at] + after}
    assert sorted(applied) == list(range(1, TOTAL_STEPS + 1))
    for epoch in range(EPOCHS):
        ids = [i for entry in applied.values() if entry["epoch"] == epoch for i in entry["ids"]]
        assert sorted(ids) == list(range(SAMPLES))
    final = torch.load(out, weights_only=True)
    assert final["result"]["steps"] == TOTAL_STEPS and final["result"]["resumed_from"]["step"] == killed_at
    assert final["result"]["micro_batch"] == 4  # the halved micro-batch came back from the checkpoint
    assert_weights_close(final["weights"], uninterrupted)


def test_in_process_resume_matches_uninterrupted_run(tmp_path, uninterrupted):
    runner, loader, _ = build(str(tmp_path))
    runner.fit(loader, epochs=EPOCHS, steps=7)  # stop mid-epoch: checkpoint at the end
    assert load_checkpoint(tmp_path)["step"] == 7
    resumed, loader, _ = build(str(tmp_path))
    result = resumed.fit(loader, epochs=EPOCHS, resume=tmp_path)
    assert result.steps == TOTAL_STEPS and result.steps_this_run == TOTAL_STEPS - 7
    assert result.micro_batch == 4 and len(result.oom_recoveries) == 1
    assert_weights_close(weights(resumed.model), uninterrupted)
    assert resumed.scheduler.last_epoch == TOTAL_STEPS


@pytest.mark.parametrize("first_epochs", [1, 2])
def test_resume_at_an_epoch_boundary_draws_the_next_epochs_order(tmp_path, uninterrupted, first_epochs):
    """A run that ended with whole epochs (its last checkpoint at position 0 of the next epoch)
    and is resumed for more: the next epoch's shuffle must come from the random state at the
    end of the last one, as in an uninterrupted run, not replay the finished epoch's order.
    Resumed twice (2 = stop again after one more epoch)."""
    runner, loader, _ = build(str(tmp_path))
    runner.fit(loader, epochs=1)
    assert load_checkpoint(tmp_path)["position"] == 0 and load_checkpoint(tmp_path)["epoch"] == 1
    if first_epochs == 2:
        again, loader, _ = build(str(tmp_path))
        again.fit(loader, epochs=2, resume=tmp_path)
        assert load_checkpoint(tmp_path)["epoch"] == 2
    resumed, loader, _ = build(str(tmp_path))
    result = resumed.fit(loader, epochs=EPOCHS, resume=tmp_path)
    assert result.steps == TOTAL_STEPS
    assert_weights_close(weights(resumed.model), uninterrupted)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1}, path)

    def torn(obj, handle, *args, **kwargs):
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_checkpoint_every_n_steps_and_contents(tmp_path):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    checkpoint_dir=tmp_path, checkpoint_every=2, progress=False)
    result = runner.fit(make_data(), epochs=2)  # 6 steps: saves after 2, 4, 6 (the end: not written again)
    assert result.checkpoints_saved == 3 and result.checkpoint_path == str(tmp_path / "last.pt")
    state = load_checkpoint(tmp_path)
    assert {"model", "optimizer", "scheduler", "rng", "epoch_rng", "step", "epoch", "position", "micro_batch"} <= set(state)
    assert (state["step"], state["epoch"], state["position"], state["micro_batch"]) == (6, 2, 0, 8)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize("stop", ["steps", "epochs"])
def test_review38_last_step_on_checkpoint_every_is_written_once(tmp_path, monkeypatch, stop):
    """A run whose last step is a ``checkpoint_every`` step wrote that checkpoint twice (the step's
    save, then fit()'s last one, the same state): once now, and it holds the run's end, as a resume
    reads it (the epoch counted finished, its next one's start), whether ``steps`` or the epochs end it."""
    from autobatch.training.checkpoints import resume

    writes = []
    monkeypatch.setattr(resume, "save_checkpoint", lambda state, path: writes.append(state["step"]) or save_checkpoint(state, path))
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    checkpoint_dir=tmp_path, checkpoint_every=3, progress=False, log_every=None)
    result = runner.fit(make_data(), **({"steps": 3} if stop == "steps" else {"epochs": 1}))  # 3 steps an epoch
    assert writes == [3] and result.checkpoints_saved == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]
    state, now = load_checkpoint(tmp_path), runner.state_dict()
    assert (state["step"], state["epoch"], state["position"]) == (now["step"], now["epoch"], now["position"]) == (3, 1, 0)
    assert all(torch.equal(state["model"][key], value) for key, value in now["model"].items())
    assert torch.equal(state["rng"]["torch"], now["rng"]["torch"]) and state["result"]["checkpoints_saved"] == 1


def test_sigkill_at_20_random_moments_resumes_bit_equal(tmp_path):
    """Kill the run with SIGKILL at 20 moments drawn with a seeded RNG from every phase
    boundary of every step and from inside the checkpoint writes (a quarter of them: half the
    bytes written, or just before the rename); resume each; every resumed run must end with
    the uninterrupted run's weights bit for bit. One worker process forks a child per run."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(report), "-", "--kill-at-random", "20", "--seed", "0"],
        env={**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(report.read_text())["runs"]
    assert len(runs) == 20 and sum(run["label"].startswith("write") for run in runs) == 5
    for run in runs:
        assert run["killed"] and run["resumed_exit"] == 0 and run["steps"] == TOTAL_STEPS, run
        assert run["bit_equal"], run


def _counting_run(global_batch: int, trained, checkpoint_dir=None) -> Runner:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)

    def loss_fn(m, batch):
        trained.extend(batch[1].tolist())
        return m(batch[0]).square().mean()

    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=global_batch,
                  micro_batch=8, checkpoint_dir=checkpoint_dir, grow_after=None, progress=False)


def _batches(global_batch: int):
    x, ids = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)), torch.arange(64)
    return [(x[i:i + global_batch], ids[i:i + global_batch]) for i in range(0, 64, global_batch)]


def test_resuming_with_another_global_batch_counts_the_same_samples(tmp_path):
    """The checkpoint's position is converted to batches of the new size (32 -> 16: batch 2);
    a position that is no whole number of them is one CheckpointError naming what to change."""
    trained: list[int] = []
    _counting_run(32, trained, tmp_path / "a").fit(_batches(32), steps=1)
    _counting_run(16, trained).fit(_batches(16), epochs=1, resume=tmp_path / "a")
    assert sorted(trained) == list(range(64))  # every sample once
    _counting_run(16, [], tmp_path / "b").fit(_batches(16), steps=1)
    with pytest.raises(autobatch.CheckpointError, match="global_batch=16"):
        _counting_run(32, []).fit(_batches(32), epochs=1, resume=tmp_path / "b")


def test_fit_again_on_the_same_runner_goes_on_inside_the_epoch():
    """steps and epochs count the whole run: a second fit() after one stopped mid-epoch trains
    the epoch's remaining batches, not its first ones again."""
    trained: list[int] = []
    runner = _counting_run(16, trained)
    runner.fit(_batches(16), steps=2)
    runner.fit(_batches(16), steps=4)
    assert sorted(trained) == list(range(64)) and runner.epoch == 1
