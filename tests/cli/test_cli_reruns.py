"""Running ``train`` again: after a run that failed, into a shared checkpoint directory, from a
checkpoint that is done or is not a checkpoint. Each refusal is one line naming the key to
change; nothing that records progress is overwritten."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import training_memory
from autobatch.cli.training import check_fresh_target, check_resume_target, read_checkpoint, run_files
from autobatch.errors import CheckpointError

from conftest import SMALL

TRAIN = ["model=mlp", *SMALL[:3], "train.micro_batch=8", "train.steps=2"]


def test_a_run_that_failed_before_its_first_update_does_not_block_the_corrected_command(cli_here, tmp_path):
    """An OOM at step 0 leaves an empty metrics.jsonl and no checkpoint: the corrected command
    into the same run directory trains (it was refused as "already holds a run", and the
    train.resume=latest it advised found no checkpoint). No probe ran, so the note names only
    the budget it trained within."""
    failed = cli_here("train", *TRAIN, "train.inject_oom=[[0,forward]]", "train.inject_oom_times=null")
    assert failed.returncode == 1, failed.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""
    done = cli_here("train", *TRAIN)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "note            trained within 64.00 MiB (device.simulated_budget), the CPU's simulated budget" in done.stdout
    assert "the memory the probe was given" not in done.stdout  # no probe ran (train.micro_batch)


def test_run_files_counts_only_metrics_that_record_an_update(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert run_files(tmp_path, "checkpoints") == []
    check_fresh_target(tmp_path, "checkpoints")  # no obstacle
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"ste')  # one update, then a torn line
    assert run_files(tmp_path, "checkpoints") == [str(tmp_path / "metrics.jsonl")]
    with pytest.raises(ValueError, match="it has no checkpoint to continue from; give a new hydra.run.dir"):
        check_fresh_target(tmp_path, "checkpoints")  # progress is never overwritten


def test_resume_past_train_steps_is_one_line_and_writes_nothing(cli_here, tmp_path):
    assert cli_here("train", *TRAIN).returncode == 0
    other = tmp_path / "other"
    done = cli_here("train", *TRAIN[:-1], "train.steps=2", "train.resume=latest", f"hydra.run.dir={other}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("autobatch: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "is at step 2 >= train.steps=2" in done.stderr and "raise train.steps" in done.stderr
    assert not (other / "metrics.jsonl").exists() and not (other / "final_model.pt").exists()


def test_an_absolute_checkpoint_dir_that_holds_a_checkpoint_names_train_checkpoint_dir(tmp_path):
    """Every run with an absolute train.checkpoint_dir writes the same last.pt: a fresh run (or
    another run's resume) would overwrite it, and a new hydra.run.dir cannot help."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "last.pt").write_bytes(b"progress")
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match=r"train.checkpoint_dir=\S+ already holds a checkpoint .* give another train.checkpoint_dir") as caught:
        check_fresh_target(fresh, str(shared))
    assert "hydra.run.dir" not in str(caught.value)
    elsewhere = tmp_path / "elsewhere" / "last.pt"
    with pytest.raises(ValueError, match="give another train.checkpoint_dir"):
        check_resume_target(elsewhere, fresh, str(shared), str(elsewhere))
    assert check_resume_target(shared / "last.pt", fresh, str(shared), "latest") is True  # its own: continued
    assert (shared / "last.pt").read_bytes() == b"progress"


def test_a_resume_file_that_is_not_a_checkpoint_says_so(tmp_path):
    result = tmp_path / "train_result.json"
    result.write_text('{"steps": 3}\n')
    with pytest.raises(CheckpointError, match="it is not an autobatch checkpoint; give train.resume the last.pt") as caught:
        read_checkpoint(result)
    assert "could run code" not in str(caught.value)


@pytest.mark.parametrize("probed, note", [
    (False, "trained within 64.00 MiB (device.simulated_budget), the CPU's simulated budget"),
    (True, "trained within 64.00 MiB (device.simulated_budget), the memory the probe was given"),
])  # fmt: skip
def test_the_training_memory_note_mentions_the_probe_only_when_one_ran(probed, note):
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=["device=auto"])
    with training_memory(cfg, torch.device("cpu"), probed=probed) as said:
        assert said == note


def test_a_run_resumed_in_the_probes_budget_trains_as_the_uninterrupted_one(cli_here, tmp_path):
    """The checkpoint is read into host memory and its optimizer state copied onto the simulated
    device, as a GPU run's is: a resume under the 2 MiB its probe was given counted the
    checkpoint's random states and failed its first step at the answer the run trained before."""
    # the second run's probe is the first one's, from the cache: the same micro-batch, one probe fewer
    common = ["model=mlp", "data.shape=[64]", "probe.memory_limit=2MiB"]
    full = cli_here("train", *common, "train.steps=6", f"hydra.run.dir={tmp_path / 'full'}", dirs=False)
    part = cli_here("train", *common, "train.steps=3", f"hydra.run.dir={tmp_path / 'part'}", dirs=False)
    resumed = cli_here("train", *common, "train.steps=6", "train.resume=latest", f"hydra.run.dir={tmp_path / 'part'}", dirs=False)
    assert full.returncode == part.returncode == resumed.returncode == 0, resumed.stderr
    summary = json.loads((tmp_path / "part" / "train_result.json").read_text())
    assert summary["oom_recoveries"] == [] and summary["steps"] == 6
    final, uninterrupted = (torch.load(tmp_path / run / "final_model.pt") for run in ("part", "full"))
    assert all(torch.equal(final[name], uninterrupted[name]) for name in final)


def test_one_training_run_a_directory_and_no_probe_over_one(tmp_path):
    """Two runs started in the same second share Hydra's default directory: the second one is
    refused while the first holds it (a claim with its process id; a dead owner's is taken
    over); a probe given a training run's directory is refused instead of overwriting it."""
    from autobatch.cli.run_dir import CLAIM, check_probe_target, claim_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / CLAIM).write_text("1\n")  # pid 1 (init) is alive and not this process
    with pytest.raises(ValueError, match="in use by another training run"):
        claim_run_dir(run)
    (run / CLAIM).write_text("999999999\n")  # a run killed outright: no such process
    claim_run_dir(run)
    assert (run / CLAIM).read_text().strip() == str(os.getpid())
    claim_run_dir(run)  # this process's own claim: a second run in the same process (a sweep) goes on
    with pytest.raises(ValueError, match="holds a training run"):
        check_probe_target(run)
    check_probe_target(tmp_path / "elsewhere")


def test_review36_a_sweep_jobs_refusal_names_hydra_sweep_dir(tmp_path, monkeypatch):
    """A train sweep run again into its hydra.sweep.dir is refused job by job (each job's
    directory holds the earlier job's run): the advice named hydra.run.dir, which a sweep's
    jobs do not read, so following it ran into the same refusals."""
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from autobatch.cli.run_dir import check_probe_target, check_train_target

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    node = SimpleNamespace(mode=RunMode.MULTIRUN)
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: node))
    with pytest.raises(ValueError, match="give a new hydra.sweep.dir") as caught:
        check_train_target(tmp_path, "checkpoints")
    assert "hydra.run.dir" not in str(caught.value)
    with pytest.raises(ValueError, match="give the probe its own hydra.sweep.dir"):
        check_probe_target(tmp_path)
    node.mode = RunMode.RUN  # one run: its own directory is hydra.run.dir, as before
    with pytest.raises(ValueError, match="give a new hydra.run.dir"):
        check_train_target(tmp_path, "checkpoints")
