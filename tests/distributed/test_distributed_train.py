"""``python -m autobatch train`` under torchrun: two ranks on the CPU (gloo), each training its
share of every global batch, rank 0 alone writing into the run directory.

Every two-rank run is compared with one process training the same global batches
(``autobatch train`` without torchrun, through the CLI's ``main`` in the test's process). The
weights are float32 and the two runs sum the same gradients in a different order (per-rank means, then a weighted all-reduce; a
halved micro-batch after an OOM adds more terms), so they agree to ``rtol=1e-5, atol=1e-6``,
not bit for bit. Each torchrun launch has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import launcher
from conftest import REPO, cli_env, cli_in_process
from autobatch.cli.dataset_shapes import PEEK as SHAPE_PEEK
from autobatch.planning.samples import spread_indices

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

TIMEOUT_S = 120  # a launch takes about 7 s on a 2-core machine
TESTS = Path(__file__).resolve().parents[1]
#: model=mlp; 64 samples, global batch 16 (8 per rank), micro-batch 4, 8 steps = 2 epochs.
COMMON = [
    "device=cpu", "model=mlp", "model.width=32", "data.shape=[16]", "train.global_batch=16", "train.grow_after=0",
    "train.log_every=0",
]  # fmt: skip
MICRO = ["train.micro_batch=4"]
#: instead of MICRO: plan each rank's share of 8 with a probe capped at 4 (micro-batch 4 x 2)
PLANNED = ["probe.max_batch=4", "probe.steps_per_trial=1", "probe.strategy=binary", "probe.plot=false"]
DATA = {
    # a shuffled dataset (train.shuffle=true by default) that records which samples it served
    "dataset": ["data=dataset", "data.dataset._target_=recording_dataset.RecordingDataset", "data.dataset.size=64"],
    "synthetic": ["data.num_samples=64"],
}
STEPS = 8
RUN_FILES = {".hydra", "checkpoints", "final_model.pt", "metrics.jsonl", "train.log", "train_result.json"}


def env(**extra: str) -> dict[str, str]:
    environment = cli_env(**extra)
    environment["PYTHONPATH"] = f"{REPO}:{TESTS}"  # recording_dataset
    return environment


def torchrun(*args: str, cwd: Path, environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node 2 -m autobatch train *args``."""
    return launcher.torchrun("train", *args, cwd=cwd, env=environment or env(), timeout=TIMEOUT_S)


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(run: Path, reference: Path) -> None:
    got, expected = torch.load(run / "final_model.pt"), torch.load(reference / "final_model.pt")
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process training the same global batches: ``reference(data)`` -> its run directory."""
    runs: dict[str, Path] = {}

    def run(data: str) -> Path:
        if data not in runs:
            base = tmp_path_factory.mktemp(f"reference-{data}")
            # in this process (``recording_dataset`` imports from the tests folder here too):
            # a subprocess would only add ~4 s of imports to what is compared
            code = cli_in_process("train", *COMMON, *MICRO, *DATA[data], f"train.steps={STEPS}", f"hydra.run.dir={base / 'run'}", cwd=base)
            assert code == 0
            runs[data] = base / "run"
        return runs[data]

    return run


def test_two_ranks_train_disjoint_shares_and_rank_zero_writes(tmp_path, reference):
    records = tmp_path / "records"
    records.mkdir()
    run = tmp_path / "run"
    done = torchrun(*COMMON, *MICRO, *DATA["dataset"], f"train.steps={STEPS}", f"hydra.run.dir={run}", cwd=tmp_path,
                    environment=env(RECORD_DIR=str(records)))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # rank 0 alone wrote into the run directory, and printed; rank 1 wrote nothing anywhere
    assert {p.name for p in run.iterdir()} == RUN_FILES
    assert list(tmp_path.rglob("metrics.jsonl")) == [run / "metrics.jsonl"] and not (tmp_path / "outputs").exists()
    assert "[rank 1]" not in (run / "train.log").read_text()
    assert done.stdout.count("train_result.json") == 1 and "2 ranks x micro-batch 4 x 2" in done.stdout
    metrics = metrics_of(run)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["samples"] == 16 and m["ranks"] == 2 and m["micro_batch"] == 4 and m["accumulation"] == 2 for m in metrics)
    summary = json.loads((run / "train_result.json").read_text())
    assert summary["samples"] == STEPS * 16 and summary["ranks"] == 2 and summary["per_rank_batch"] == 8

    # every epoch: each sample trained exactly once, by one rank; a new order each epoch
    read = {rank: [int(i) for i in (records / f"rank{rank}.txt").read_text().split()] for rank in (0, 1)}
    assert read[0][0] == read[1][0] == 0  # each rank reads the first sample once to check the model's input kind
    # ... and a few spread over the set to check their shapes match (autobatch.cli.dataset_shapes)
    checked = spread_indices(64, SHAPE_PEEK)
    assert read[0][1:1 + len(checked)] == read[1][1:1 + len(checked)] == checked
    served = {rank: indices[1 + len(checked):] for rank, indices in read.items()}
    assert len(served[0]) == len(served[1]) == 2 * 32
    epochs = [[served[rank][e * 32 : (e + 1) * 32] for rank in (0, 1)] for e in (0, 1)]
    for first, second in epochs:
        assert sorted(first + second) == list(range(64))
    assert epochs[0][0] != epochs[1][0]

    # the same global batches as one process: the same weights and losses, up to summation order
    expected = reference("dataset")
    assert_same_weights(run, expected)
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in metrics_of(expected)], rel=1e-5)


def test_a_planned_run_recovers_both_ranks_from_an_oom_on_rank_one(tmp_path, reference):
    run = tmp_path / "run"
    done = torchrun(*COMMON, *PLANNED, *DATA["synthetic"], f"train.steps={STEPS}", "train.inject_oom=[[2,backward]]",
                    "train.inject_oom_ranks=[1]", f"hydra.run.dir={run}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())  # the plan is for each rank's share
    assert (plan["global_batch"], plan["micro_batch"], plan["accumulation_steps"]) == (8, 4, 2)
    assert (plan["ranks"], plan["global_batch_all_ranks"], plan["per_rank_batch"]) == (2, 16, 8)
    assert "global batch    16 over 2 ranks, 8 per rank" in done.stdout
    logs = done.stdout + done.stderr
    # each rank logs its own recovery: rank 1 from its injected OOM, rank 0 from its peer's
    assert "[rank 1][autobatch][WARNING] - OOM at step 2 in backward with micro-batch 4" in logs
    assert sum("OOM at step 2 in backward with micro-batch 4" in line for line in logs.splitlines()) == 2
    summary = json.loads((run / "train_result.json").read_text())
    (recovery,) = summary["oom_recoveries"]
    assert (recovery["step"], recovery["phase"], recovery["micro_batch_before"], recovery["micro_batch"]) == (2, "backward", 4, 2)
    assert "rank 1 ran out of memory" in recovery["error"]
    metrics = metrics_of(run)
    assert [(m["micro_batch"], m["accumulation"], m["recoveries"]) for m in metrics[1:4]] == [(4, 2, 0), (2, 4, 1), (2, 4, 1)]
    assert summary["samples"] == STEPS * 16
    assert_same_weights(run, reference("synthetic"))


def test_a_run_resumed_under_torchrun_replays_the_same_batches(tmp_path, reference):
    run = tmp_path / "run"
    first = torchrun(*COMMON, *MICRO, *DATA["dataset"], "train.steps=3", "train.checkpoint_every=1", f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    done = torchrun(*COMMON, *MICRO, *DATA["dataset"], f"train.steps={STEPS}", f"train.resume={run}", f"hydra.run.dir={run}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run / "train_result.json").read_text())
    assert summary["resumed_from"]["step"] == 3 and summary["steps_this_run"] == STEPS - 3
    assert [m["step"] for m in metrics_of(run)] == list(range(1, STEPS + 1))
    assert_same_weights(run, reference("dataset"))  # mid-epoch 1 to epoch 2: same permutations, same batches


def test_a_global_batch_that_does_not_split_over_the_ranks_is_one_line(tmp_path):
    done = torchrun(*COMMON, *MICRO, *DATA["synthetic"], "train.global_batch=15", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode != 0
    message = "autobatch: error: train.global_batch=15 does not split evenly over 2 ranks"
    lines = [line for line in done.stderr.splitlines() if line.startswith("autobatch: error:")]
    assert lines and all(line.startswith(message) for line in lines), done.stderr[-3000:]
    assert "e.g. train.global_batch=14 or 16" in lines[0]
    assert "Traceback" not in done.stdout
