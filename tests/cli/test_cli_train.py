"""``probe``/``train`` with a global batch (the plan), the runner's options, and a run that is
killed with SIGKILL and resumed through the command line.

The resumed run must end with the uninterrupted run's weights *exactly* (``torch.equal``):
the same micro-batch splits, the same batches and the same random numbers (dropout) on one
CPU thread, so there is not even summation-order noise.
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

from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from autobatch.cli.training import find_resume

from conftest import SMALL, cli_env, cli_in_process, run_cli

#: A small GPT with dropout; global batch 16 = 2 x micro-batch 8; an injected OOM at step
#: index 1 halves the micro-batch to 4, which the checkpoint must carry.
RESUME_RUN = [
    "model=gpt", "model.dropout=0.1", "model.width=32", "data.seq_len=16", "data.num_samples=64",
    "train.global_batch=16", "train.micro_batch=8", "train.steps=12", "train.checkpoint_every=1",
    "train.inject_oom=[[1,backward]]", "train.grow_after=0",
]  # fmt: skip
TOTAL = 12


def metrics_of(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_probe_with_a_global_batch_prints_and_writes_the_plan(cli_here, tmp_path):
    done = cli_here("probe", "model=mlp", *SMALL[:3], "probe.max_batch=48", "probe.steps_per_trial=1", "train.global_batch=200")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert plan["global_batch"] == 200 and plan["accumulation_steps"] == 5 and plan["micro_batch"] == 40
    assert sum(plan["micro_batch_sizes"]) == 200 and plan["objective"] == "max_batch"
    assert result["batch_size"] == 48  # the plan's probe, capped by probe.max_batch
    assert done.stdout.index("batch size") < done.stdout.index("global batch    200")  # probe table, then plan
    assert "micro-batch     40 x 5 accumulation steps" in done.stdout


def test_plan_timing_keys_reach_the_throughput_planner(cli_here, tmp_path):
    knobs = ["plan.warmup_steps=0", "plan.timed_steps=2", "plan.retime_rounds=1", "plan.retime_within=0.5"]
    args = ["model=mlp", *SMALL[:3], "probe.max_batch=32", "probe.steps_per_trial=1", "train.global_batch=64"]
    done = cli_here("probe", *args, "plan.objective=throughput", "plan.min_micro_batch=4", *knobs)
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert min(c["micro_batch"] for c in plan["candidates"]) >= 4  # plan.min_micro_batch
    assert {k: plan["timing"][k] for k in ("warmup_steps", "timed_steps", "retime_rounds", "retime_within")} == {
        "warmup_steps": 0, "timed_steps": 2, "retime_rounds": 1, "retime_within": 0.5
    }
    rounds = sorted(c["rounds"] for c in plan["candidates"])
    assert set(rounds) <= {1, 2} and rounds.count(2) == plan["timing"]["retimed"]
    # timed_steps=2 a round; a candidate whose first step took over twice the best's stops there
    assert all(len(c["step_seconds"]) == (1 if c["pruned"] else 2 * c["rounds"]) for c in plan["candidates"])
    assert "median s/step" in done.stdout


def test_train_runs_the_plan_and_recovers_from_an_injected_oom(cli_here, tmp_path):
    args = ["model=mlp", *SMALL[:3], "probe.max_batch=32", "probe.steps_per_trial=1", "train.global_batch=64"]
    done = cli_here("train", *args, "train.steps=5", "train.inject_oom=[[2,forward]]", "plan.balanced=false")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    summary = json.loads((run / "train_result.json").read_text())
    assert summary["plan"]["micro_batch"] == 32 and summary["plan"]["accumulation_steps"] == 2
    assert summary["steps"] == 5 and summary["samples"] == 5 * 64 and summary["global_batch"] == 64
    (recovery,) = summary["oom_recoveries"]
    assert (recovery["step"], recovery["phase"], recovery["micro_batch_before"], recovery["micro_batch"]) == (2, "forward", 32, 16)
    metrics = metrics_of(run)
    assert [(m["step"], m["micro_batch"], m["accumulation"], m["recoveries"]) for m in metrics] == [
        (1, 32, 2, 0), (2, 32, 2, 0), (3, 16, 4, 1), (4, 16, 4, 1), (5, 16, 4, 1),
    ]  # fmt: skip
    assert all(m["samples"] == 64 and m["samples_per_s"] > 0 for m in metrics)
    assert "OOM at step 2 in forward" in done.stdout + done.stderr and "oom recoveries  1" in done.stdout


def test_train_runs_within_the_memory_the_probe_was_given(cli_here, tmp_path):
    """``probe.memory_limit`` is the question ("what trains in 2 MiB?"): training runs under the
    same cap, so a micro-batch that does not fit there runs out of memory and is sized down from
    measured memory (no injected fault), where the whole device (no limit) trains it as asked."""
    args = ["model=mlp", *SMALL[:3], "device=cpu", "train.micro_batch=8000", "train.global_batch=8000", "train.steps=2"]
    done = cli_here("train", *args, "probe.memory_limit=2MiB")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert summary["oom_recoveries"] and summary["oom_recoveries"][0]["action"] == "measured"
    assert summary["micro_batch"] < 8000 and summary["samples"] == 2 * 8000
    assert "trained within 2.00 MiB (probe.memory_limit)" in done.stdout
    done = cli_here("train", *args, f"hydra.run.dir={tmp_path / 'whole'}", dirs=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "whole" / "train_result.json").read_text())
    assert summary["oom_recoveries"] == [] and summary["micro_batch"] == 8000 and "trained within" not in done.stdout


def test_training_afresh_never_overwrites_a_run(cli_here, tmp_path):
    """A second ``train`` into a run directory that holds a run (its metrics, its checkpoint)
    would overwrite them: one line, exit 2, naming how to continue it; nothing is touched."""
    args = ["model=mlp", *SMALL[:3], "train.micro_batch=8", "train.steps=2"]
    assert cli_here("train", *args).returncode == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes(), (tmp_path / "run/checkpoints/last.pt").read_bytes()
    done = cli_here("train", *args)
    assert done.returncode == 2 and "already holds a run" in done.stderr and "train.resume=latest" in done.stderr
    assert before == ((tmp_path / "run" / "metrics.jsonl").read_bytes(), (tmp_path / "run/checkpoints/last.pt").read_bytes())


def test_an_oom_that_never_goes_away_is_one_line(cli_here):
    args = ["model=mlp", *SMALL[:3], "train.micro_batch=2", "train.steps=3", "train.grow_after=0"]
    done = cli_here("train", *args, "train.inject_oom=[[1,backward]]", "train.inject_oom_times=null")
    assert done.returncode == 1
    assert done.stderr.startswith("autobatch: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "step 1" in done.stderr and "Traceback" not in done.stderr


def test_min_micro_batch_keeps_the_recovery_above_it_and_its_error_names_the_key(cli_here):
    args = ["model=mlp", *SMALL[:3], "train.micro_batch=8", "train.global_batch=8", "train.steps=3", "train.grow_after=0"]
    done = cli_here("train", *args, "train.min_micro_batch=2", "train.inject_oom=[[1,forward]]", "train.inject_oom_times=null")
    assert done.returncode == 1
    assert "at micro-batch 2, the smallest train.min_micro_batch=2 allows" in done.stderr, done.stderr
    bad = cli_here("train", *args, "train.min_micro_batch=0")
    assert bad.returncode == 2 and "train.min_micro_batch must be a positive integer" in bad.stderr


def test_sigkill_and_resume_through_the_cli(tmp_path):
    # the uninterrupted run in this process (the killed and the resumed runs are real processes):
    # its losses and weights are what both must reproduce
    assert cli_in_process("train", *RESUME_RUN, f"hydra.run.dir={tmp_path / 'reference'}", cwd=tmp_path) == 0

    run = tmp_path / "run"
    command = [sys.executable, "-m", "autobatch", "train", *RESUME_RUN, "train.inject_delay=0.3", f"hydra.run.dir={run}"]
    with open(tmp_path / "killed.log", "w") as log:
        worker = subprocess.Popen(command, cwd=tmp_path, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while len(metrics_of(run)) < 4 and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = worker.poll() is None
        if alive:
            os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=60)
    assert alive, f"the run ended before it could be killed: {(tmp_path / 'killed.log').read_text()[-2000:]}"
    assert worker.returncode == -signal.SIGKILL and not (run / "final_model.pt").exists()
    killed_at = load_checkpoint(run / "checkpoints")["step"]
    assert 3 <= killed_at < TOTAL
    # The metrics line of a step is written before its checkpoint: at most one line past it.
    assert [m["step"] for m in metrics_of(run)] in (list(range(1, killed_at + 1)), list(range(1, killed_at + 2)))

    done = run_cli("train", *RESUME_RUN, f"train.resume={run}", f"hydra.run.dir={run}", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((run / "train_result.json").read_text())
    assert summary["steps"] == TOTAL and summary["steps_this_run"] == TOTAL - killed_at
    assert summary["resumed_from"]["step"] == killed_at and summary["probe"] is None
    assert summary["micro_batch"] == 4 and len(summary["oom_recoveries"]) == 1  # carried by the checkpoint
    # Every step exactly once, with the uninterrupted run's losses; the same final weights.
    metrics, expected = metrics_of(run), metrics_of(tmp_path / "reference")
    assert [m["step"] for m in metrics] == list(range(1, TOTAL + 1))
    assert [m["loss"] for m in metrics] == [m["loss"] for m in expected]
    final = torch.load(run / "final_model.pt")
    uninterrupted = torch.load(tmp_path / "reference" / "final_model.pt")
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[name], uninterrupted[name]) for name in final)


def test_find_resume_accepts_files_directories_runs_and_latest(tmp_path):
    def checkpoint(run: str, age: float) -> Path:
        path = tmp_path / run / "checkpoints" / "last.pt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    old = checkpoint("outputs/train/2026-01-01/10-00-00", age=100)
    new = checkpoint("outputs/train/2026-01-02/10-00-00", age=10)
    assert find_resume(str(old), "checkpoints", tmp_path) == old
    assert find_resume(str(old.parent), "checkpoints", tmp_path) == old
    assert find_resume("outputs/train/2026-01-01/10-00-00", "checkpoints", tmp_path) == old  # a run directory
    assert find_resume("latest", "checkpoints", tmp_path) == new
    assert find_resume("latest", "checkpoints", tmp_path, run_dir=old.parents[1]) == old  # the run's own first
    with pytest.raises(ValueError, match="train.resume='nowhere': no checkpoint"):
        find_resume("nowhere", "checkpoints", tmp_path)
    with pytest.raises(ValueError, match="train.resume=latest: no checkpoint"):
        find_resume("latest", "checkpoints", tmp_path / "empty")


def test_fp16_trains_with_a_grad_scaler_through_the_cli(cli_here, tmp_path):
    args = ["model=mlp", *SMALL[:3], "precision=fp16", "train.global_batch=16", "train.micro_batch=8", "train.steps=3"]
    done = cli_here("train", *args, "train.inject_oom=[[1,optimizer]]", "train.grow_after=0")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert summary["steps"] == 3 and [r["phase"] for r in summary["oom_recoveries"]] == ["optimizer"]
    assert "skipped_steps" in summary
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["grad_scaler"]["scale"] > 0  # the scaler's state is checkpointed for resume


def test_train_can_probe_in_a_child_process_and_trains_from_its_answer(cli_here, tmp_path):
    """``probe.isolate=true`` (the default on CUDA): the probe runs as ``python -m autobatch probe``
    with the job's overrides in its own process, writing into the run's ``probe/``; training
    starts from that answer in a process no trial ran in. (The parent is ``main`` in this test's
    process; the child is a real one.)"""
    args = ["model=mlp", *SMALL[:3], "device=cpu", "probe.memory_limit=2MiB", "probe.cache=false", "train.steps=2"]
    done = cli_here("train", *args, "probe.isolate=true")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    child = json.loads((run / "probe" / "result.json").read_text())
    summary = json.loads((run / "train_result.json").read_text())
    assert summary["micro_batch"] == child["batch_size"] == summary["probe"]["batch_size"]
    assert summary["oom_recoveries"] == [] and any("probed in a child process" in n for n in summary["notes"])
    assert "model=mlp" in child["command"] and "probe.isolate=false" in child["command"]
    assert json.loads((run / "result.json").read_text())["batch_size"] == child["batch_size"]


def test_probe_isolate_says_where_it_cannot_run(cli_here):
    done = cli_here("train", "model=mlp", *SMALL[:3], "device=cpu", "probe.isolate=true", "train.global_batch=64")
    assert done.returncode == 2 and "probe.isolate=true probes without a plan" in done.stderr


def test_the_childs_command_keeps_the_jobs_overrides_and_config_flags(tmp_path):
    from autobatch.cli.isolated import child_command

    argv = ["-cd", "/my/conf", "--config-name=exp", "model=mlp,gpt", "-m"]
    task = ["model=gpt", "+model.extra=1", "hydra.verbose=true", "train.steps=5"]
    command = child_command(tmp_path / "probe", argv=argv, task=task)
    assert command[1:4] == ["-m", "autobatch", "probe"]
    assert command[4:] == ["-cd", "/my/conf", "--config-name=exp", "model=gpt", "+model.extra=1", "train.steps=5",
                           f"hydra.run.dir={tmp_path / 'probe'}", "probe.isolate=false"]


@pytest.mark.parametrize("model", [
    ["model=mlp", "data.shape=[16]", "model.width=32", "probe.memory_limit=2MiB"],
    ["model=cnn", "data.shape=[3,16,16]", "probe.memory_limit=8MiB"],
    ["model=gpt", "data.seq_len=16", "model.width=32", "probe.memory_limit=16MiB"],
], ids=["mlp", "cnn", "gpt"])
def test_the_clis_answer_trains_within_the_budget_it_was_probed_under(cli_here, tmp_path, model):
    """Issue 16 through the command line: ``train`` probes (same process on the CPU), then trains
    at the answer under the same simulated budget with no out-of-memory recovery. The global batch
    is host memory, as on a GPU; only the runner's move of a micro-batch takes device memory."""
    done = cli_here("train", *model, "device=cpu", "probe.cache=false", "train.steps=5")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert summary["oom_recoveries"] == [] and summary["micro_batch"] == summary["probe"]["batch_size"] > 1


def test_a_child_probes_layout_is_not_claimed_by_the_training_process(tmp_path, monkeypatch):
    """The child laid out its own optimizer state (fixed segments); the process that trains laid
    out nothing, so the answer it takes over says nothing of it, as a cache hit does."""
    from autobatch.cli import isolated
    from autobatch.probe.promise import LAID_OUT, laid_out_note
    from autobatch.probe.result import ProbeResult

    written = ProbeResult(batch_size=7, strategy="auto", strategy_used="predict", trials=[], capacity_bytes=2**20,
                          elapsed_s=0.1, margin=0.0, notes=[laid_out_note(2**20), "kept"],
                          promise={"laid_out_state_bytes": 2**20})

    def child(command, check, **kwargs):
        (tmp_path / "result.json").write_text(json.dumps({**written.to_dict(), "command": "x", "config": {}}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(isolated, "child_command", lambda out_dir: ["probe"])
    monkeypatch.setattr(isolated.subprocess, "run", child)
    result = isolated.probe_in_child(tmp_path)
    assert result.batch_size == 7 and result.notes == ["kept"] and result.promise == {}
    assert not any(note.startswith(LAID_OUT) for note in result.notes)


def test_resume_latest_continues_the_run_dirs_own_run_and_never_writes_into_another(cli_here, tmp_path):
    """``train.resume=latest`` with ``hydra.run.dir`` of a run resumes that run (not the newest
    elsewhere); without a run dir it finds the newest run at any depth under outputs/train; and
    another run's checkpoint is never resumed into a directory that holds a run."""
    args = ["model=mlp", *SMALL[:3], "train.micro_batch=4", "train.checkpoint_every=1", "train.grow_after=0"]
    run_a, run_b = tmp_path / "outputs" / "train" / "runA", tmp_path / "outputs" / "train" / "runB"
    for run, steps in ((run_a, 2), (run_b, 3)):
        done = cli_here("train", *args, f"train.steps={steps}", f"hydra.run.dir={run}", dirs=False)
        assert done.returncode == 0, done.stderr
    os.utime(run_a / "checkpoints" / "last.pt", (time.time() - 100, time.time() - 100))  # runB is the newest
    b_files = {name: (run_b / name).read_bytes() for name in ("metrics.jsonl", "checkpoints/last.pt")}

    done = cli_here("train", *args, "train.steps=4", "train.resume=latest", f"hydra.run.dir={run_a}", dirs=False)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {run_a / 'checkpoints' / 'last.pt'} at step 2" in done.stdout
    assert [m["step"] for m in metrics_of(run_a)] == [1, 2, 3, 4] and load_checkpoint(run_a / "checkpoints")["step"] == 4
    assert {name: (run_b / name).read_bytes() for name in b_files} == b_files  # runB untouched

    done = cli_here("train", *args, "train.steps=5", "train.resume=latest", dirs=False)  # a new run dir
    assert done.returncode == 0, done.stderr
    assert f"resumed from {run_a / 'checkpoints' / 'last.pt'} at step 4 into a new run directory" in done.stdout
    (new,) = (tmp_path / "outputs" / "train").glob("*/*/metrics.jsonl")  # outputs/train/<date>/<time>
    assert [m["step"] for m in metrics_of(new.parent)] == [5]  # its own metrics: none of runA's lines

    before = (run_a / "metrics.jsonl").read_bytes()
    done = cli_here("train", *args, "train.steps=6", f"train.resume={run_b}", f"hydra.run.dir={run_a}", dirs=False)
    assert done.returncode == 2 and "holds another run" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert (run_a / "metrics.jsonl").read_bytes() == before and load_checkpoint(run_a / "checkpoints")["step"] == 4


def test_find_resume_latest_prefers_the_run_dir_and_searches_nested_and_absolute_dirs(tmp_path):
    def checkpoint(path: Path, age: float) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    own = checkpoint(tmp_path / "outputs/train/runA/checkpoints/last.pt", age=100)
    newest = checkpoint(tmp_path / "multirun/train/a/b/c/d/checkpoints/last.pt", age=10)
    assert find_resume("latest", "checkpoints", tmp_path) == newest  # any depth
    assert find_resume("latest", "checkpoints", tmp_path, run_dir=own.parents[1]) == own
    assert find_resume("latest", "checkpoints", tmp_path, run_dir=tmp_path / "fresh") == newest
    absolute = checkpoint(tmp_path / "elsewhere" / "last.pt", age=50)
    assert find_resume("latest", str(absolute.parent), tmp_path / "other", run_dir=tmp_path / "fresh") == absolute
    assert find_resume(str(own.parents[1]), str(absolute.parent), tmp_path) == absolute  # what the run writes


def test_every_rank_judges_the_resume_target_before_any_rank_writes(tmp_path, monkeypatch):
    """Under torchrun rank 0 made metrics.jsonl while a later rank still checked the shared run
    directory, which then looked like another run's: every rank checks, then one sync point
    (a refusal on any rank stops every rank, each with a message)."""
    from autobatch.cli import resume_job as commands  # where the judgement lives

    run = tmp_path / "outputs/train/runA"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints/last.pt").write_bytes(b"x")
    calls = []
    monkeypatch.setattr(commands.dist_sync, "is_distributed", lambda: True)
    monkeypatch.setattr(commands, "check_resume_target", lambda *a: calls.append("check") or False)
    monkeypatch.setattr(commands.dist_sync, "exchange", lambda values, label: calls.append(label) or [values, [1]])
    with pytest.raises(ValueError, match="rank 1 refused it"):
        commands.agreed_resume_target(str(run), "checkpoints", tmp_path, tmp_path / "new")
    assert calls == ["check", "cli: resume target"]


def test_an_isolated_probe_imports_the_users_module_under_hydra_job_chdir(cli, tmp_path):
    """``hydra.job.chdir=true`` moves the job into its run directory; the child probe starts where
    the command ran, so ``model._target_`` from the user's own package imports there too."""
    package = tmp_path / "user_models_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import torch\n"
        "class Tiny(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 10))\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n"
    )
    args = ["model=target", "model._target_=user_models_pkg.Tiny", "data.shape=[16]", "device=cpu",
            "probe.memory_limit=2MiB", "probe.cache=false", "train.steps=2"]
    done = cli("train", *args, "hydra.job.chdir=true", "probe.isolate=true")
    assert done.returncode == 0, done.stderr
    child = json.loads((tmp_path / "run" / "probe" / "result.json").read_text())
    assert json.loads((tmp_path / "run" / "train_result.json").read_text())["micro_batch"] == child["batch_size"]


def test_a_finite_dataset_caps_the_probe_and_the_global_batch(cli_here, tmp_path):
    """A batch larger than the dataset would repeat its samples: the probe stops at its length."""
    done = cli_here("train", "model=mlp", *SMALL[:3], "data=dataset", "data.dataset.size=64", "train.steps=2", "probe.cache=false")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert summary["probe"]["batch_size"] == summary["global_batch"] == 64
    assert any("capped at 64, the samples in data.dataset" in note for note in summary["probe"]["notes"])
    assert [m["samples"] for m in metrics_of(tmp_path / "run")] == [64, 64]
    assert "global batch 64 = micro-batch 64 x 1" in done.stdout


def test_review35_the_foreach_switch_names_the_override_on_the_command_line(caplog):
    """When the runner switches a foreach optimizer to foreach=False its warning said "build the
    optimizer with foreach=False": under ``train`` it names the override (``+`` only where the
    config has no ``optimizer.foreach``, which Hydra would refuse to add again)."""
    from omegaconf import OmegaConf

    from autobatch.cli.log_advice import advice_in_logs
    from autobatch.probe.foreach import drop_foreach

    for node, override in (({"_target_": "torch.optim.AdamW"}, "+optimizer.foreach=false"),
                           ({"_target_": "torch.optim.AdamW", "foreach": True}, "optimizer.foreach=false")):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True)
        caplog.clear()
        with caplog.at_level("WARNING", logger="autobatch"), advice_in_logs(OmegaConf.create({"optimizer": node})):
            drop_foreach(optimizer, "optimizer.step() ran out of memory twice")
        assert caplog.messages[-1].endswith(f"; give {override} to start so (the optimizer's key on the command line)")
    drop_foreach(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True), "outside the CLI")
    assert caplog.messages[-1].endswith("build the optimizer with foreach=False to start so")  # the library's own words
