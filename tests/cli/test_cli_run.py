"""``python -m autobatch probe`` and ``train`` end to end on the CPU, in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, SMALL, cli_env, run_cli


def test_help_lists_the_commands(tmp_path):
    done = run_cli("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert "probe" in done.stdout and "train" in done.stdout and "usage:" in done.stdout


def test_probe_help_is_hydras(tmp_path):
    done = run_cli("probe", "--help", cwd=tmp_path)
    assert done.returncode == 0
    assert "== Configuration groups ==" in done.stdout and "model: " in done.stdout
    assert list(tmp_path.iterdir()) == []  # --help writes nothing


def test_probe_writes_result_json_and_prints_a_table(cli_here, tmp_path):
    budget = ["probe.memory_limit=1MiB", "probe.steps_per_trial=1", "probe.multiple_of=8"]
    done = cli_here("probe", "model=mlp", "probe.strategy=binary", *budget, *SMALL[:-2])
    assert done.returncode == 0, done.stderr
    for label in ("batch size", "strategy", "trials", "peak memory", "capacity", "time"):
        assert label in done.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["batch_size"] >= 1 and result["num_ooms"] >= 1  # the 2 MiB budget was hit
    assert result["config"]["model"]["_target_"] == "autobatch.workloads.models.MLP"
    assert result["config"]["probe"]["strategy"] == "binary"
    assert result["command"].startswith("python -m autobatch probe model=mlp")
    assert (tmp_path / "run" / "probe.log").read_text().count("trial ") == result["num_trials"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing outside the run dir


@pytest.mark.parametrize("search_steps, expected", [("1", {1, 2}), ("null", {2})])
def test_probe_search_steps_reaches_the_trials(cli_here, tmp_path, search_steps, expected):
    budget = ["probe.memory_limit=1MiB", "probe.steps_per_trial=2", f"probe.search_steps={search_steps}"]
    done = cli_here("probe", "model=mlp", "probe.strategy=binary", *budget, *SMALL[:-2])
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert {t["steps"] for t in result["trials"] if t["passed"]} == expected
    answer = [t for t in result["trials"] if t["batch_size"] == result["batch_size"] and t["passed"]][-1]
    assert answer["steps"] == 2


def test_train_probes_then_trains_on_the_runner(cli_here, tmp_path):
    done = cli_here("train", "model=gpt", *SMALL, "train.steps=4", "train.checkpoint_every=2")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    summary = json.loads((run / "train_result.json").read_text())
    probed = json.loads((run / "result.json").read_text())["batch_size"]
    assert summary["global_batch"] == summary["micro_batch"] == probed and summary["steps"] == 4
    assert summary["probe"]["batch_size"] == probed and summary["oom_recoveries"] == []
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["micro_batch"] == probed and m["accumulation"] == 1 and m["samples"] == probed for m in metrics)
    assert summary["checkpoints_saved"] == 2  # after steps 2 and 4; the end's is step 4's, not written again
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.pt"]
    assert (run / "final_model.pt").is_file()


def test_train_with_micro_batch_and_epochs_skips_the_probe(cli_here, tmp_path):
    done = cli_here("train", "model=mlp", "data.shape=[8]", "data.num_samples=40", "train.micro_batch=16", "train.epochs=2")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert summary["probe"] is None and summary["global_batch"] == summary["micro_batch"] == 16
    assert summary["steps"] == 2 * 3 and summary["epochs"] == 2  # ceil(40 / 16) steps per epoch
    assert not (tmp_path / "run" / "result.json").exists()


def test_train_over_a_target_dataset(cli_here, tmp_path):
    args = ["model=mlp", "data=dataset", "data.dataset.size=40", "data.shape=[4]", "train.micro_batch=8"]
    done = cli_here("train", *args, "train.global_batch=16", "train.epochs=1")
    assert done.returncode == 0, done.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["samples"] for m in metrics] == [16, 16, 8]  # a DataLoader pass: the last batch is smaller
    assert [m["accumulation"] for m in metrics] == [2, 2, 1]


def test_library_imports_without_hydra(tmp_path):
    code = (
        "import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None\n"
        "import autobatch, autobatch.workloads.models, autobatch.workloads.batches\n"
        "print(autobatch.find_max_batch(lambda b: None, max_batch=8, memory_limit='1MiB').batch_size)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "8"
