"""A run directory's ``.hydra/`` copy of the config that made its run (review 25).

Hydra writes ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` into the run
directory before the command runs. A ``train`` (or ``probe``) given ``hydra.run.dir`` of an
earlier run was refused, but had already replaced that run's record of its config with its
own (``model._target_=mypkg.KillNet`` where the run trained ``mypkg.Net +model.hidden=64``),
which ``train.resume=<run dir>`` then reads its ``train.checkpoint_dir`` from, and appended
its ``autobatch: error:`` line to the run's ``train.log``, which then read as a run that failed.
The ``keep_run_config`` callback now leaves the ``.hydra/`` of a directory that holds a run
alone, and the log file of one it will be refused in.
"""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from autobatch.cli.run_dir import KeepRunConfig, holds_run


def _config(run_dir, name="train"):
    return OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}, "output_subdir": ".hydra", "job": {"name": name}},
                             "train": {"checkpoint_dir": "checkpoints"}})


def test_the_config_copy_is_off_only_over_a_run(tmp_path):
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "metrics.jsonl").write_text("")  # failed before its first update: nothing to keep
    for run_dir, kept in ((tmp_path / "new", False), (tmp_path / "failed", False), (tmp_path / "done", True)):
        if kept:
            (run_dir / "checkpoints").mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        config = _config(run_dir)
        KeepRunConfig().on_run_start(config=config)
        assert (config.hydra.output_subdir is None) == kept, run_dir


def test_what_each_command_would_overwrite_is_a_run(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"command": "python -m autobatch probe model=mlp"}))
    assert holds_run(tmp_path, "checkpoints", "train")
    assert not holds_run(tmp_path, "checkpoints", "probe")  # a probe rerun replaces the probe, config and all
    (tmp_path / "result.json").unlink()
    (tmp_path / "train_result.json").write_text("{}")
    assert holds_run(tmp_path, "checkpoints", "probe")  # refused over a training run


def test_a_refused_train_leaves_the_runs_config_record_alone(cli_here, tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "train_result.json").write_text("{}")
    record = "- model=target\n- model._target_=mypkg.Net\n- +model.hidden=64\n"
    (run / ".hydra" / "overrides.yaml").write_text(record)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples": 8}) + "\n")
    refused = cli_here("train", "model=mlp", "train.micro_batch=4")
    assert refused.returncode != 0 and "already holds a run" in refused.stderr
    assert (run / ".hydra" / "overrides.yaml").read_text() == record
    assert not (run / ".hydra" / "config.yaml").exists()
    assert not (run / "train.log").exists()  # the refusal is not written as the end of that run's log


def test_review36_a_sweep_job_keeps_the_record_and_log_of_the_run_in_its_directory(tmp_path):
    """A sweep's job has no on_run_start: a train sweep run again into its hydra.sweep.dir
    replaced each earlier job's .hydra/ with the refused job's config and appended the refusal
    to its train.log. The packaged configs' hydra.output_subdir now resolves to None over a
    run (Hydra reads it after setting hydra.runtime.output_dir), and on_job_start closes the
    log file of a job that will be refused there."""
    import logging

    from hydra import compose, initialize_config_module
    from hydra.types import RunMode

    import autobatch.cli  # noqa: F401 - makes autobatch.conf importable

    run = tmp_path / "0"
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        config = compose("train", overrides=["device=auto"], return_hydra_config=True)
    config.hydra.mode, config.hydra.runtime.output_dir = RunMode.MULTIRUN, str(run)
    assert config.hydra.output_subdir == ".hydra"  # a new job's directory: Hydra's copy, as before
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert config.hydra.output_subdir is None
    handler = logging.FileHandler(run / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        KeepRunConfig().on_job_start(config=config)
        assert handler not in logging.getLogger().handlers
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
