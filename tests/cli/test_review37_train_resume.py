"""``train.resume`` of a run the user changed: its checkpoint gone, or its model resized.

* ``train.resume=latest hydra.run.dir=RUN`` (the ``continue with:`` command) where ``RUN``
  recorded updates but its ``last.pt`` is gone (deleted, moved, or killed before one was
  written) took the newest checkpoint elsewhere, another run's, and was refused as "the run
  directory RUN holds another run ...; or hydra.run.dir=<other run>": it now names the missing file.
* A resume with ``model.width=32`` of a run trained at 256 was refused naming only the tensors
  ("written for another model or optimizer (size mismatch for net.1.weight ...)"): it now names
  the ``model.*`` overrides the run recorded.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from autobatch.cli.resume_state import check_same_model, read_checkpoint
from autobatch.cli.training import find_resume
from autobatch.training.checkpoints.checkpoint_io import RUNNER_FORMAT, save_checkpoint


def test_review37_latest_into_a_run_without_its_checkpoint_names_the_missing_file(tmp_path):
    other = tmp_path / "outputs" / "train" / "other" / "checkpoints"
    other.mkdir(parents=True)
    (other / "last.pt").write_bytes(b"x")  # another run's, the newest elsewhere
    run = tmp_path / "runA"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError) as raised:
        find_resume("latest", "checkpoints", tmp_path, run_dir=run)
    message = str(raised.value)
    assert f"{run} holds a run (its metrics.jsonl) but not its checkpoint {run / 'checkpoints' / 'last.pt'}" in message
    assert str(other) not in message


def test_review37_a_resized_model_is_named_by_its_keys(tmp_path):
    def mlp(width):
        return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))

    run = tmp_path / "runA"
    checkpoint = run / "checkpoints" / "last.pt"
    checkpoint.parent.mkdir(parents=True)
    saved = mlp(8)
    save_checkpoint({"format": RUNNER_FORMAT, "step": 3, "epoch": 0, "result": {"global_batch": 4},
                     "model": saved.state_dict(), "optimizer": {"param_groups": []}}, checkpoint)
    model_cfg = {"_target_": "mymods.MLP", "width": 8, "sizes": [4, 2]}
    (run / "result.json").write_text(json.dumps({"config": {"model": model_cfg}}))
    state = read_checkpoint(checkpoint)
    cfg = OmegaConf.create({"model": {**model_cfg, "width": 16}, "train": {"checkpoint_dir": "checkpoints"}})
    with pytest.raises(ValueError) as raised:
        check_same_model(cfg, state, mlp(16), checkpoint, run)
    assert "model.width=16 (the run's: 8)" in str(raised.value)
    assert "give model.width=8 to continue it" in str(raised.value)
    check_same_model(OmegaConf.create({**cfg, "model": model_cfg}), state, mlp(8), checkpoint, run)  # the same: no error


def test_review37_the_resumed_settings_warning_gives_the_command_lines_advice(caplog):
    """``train.lr=0.5`` on a resume: the runner's warning said "set them after resuming to change
    them", which the command line cannot do, beside the note saying to start afresh."""
    from autobatch.cli.log_advice import advice_in_logs
    from autobatch.training.checkpoints.resume_checks import warn_replaced_settings

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    saved = {"param_groups": [{**optimizer.param_groups[0], "lr": 0.001, "params": [0, 1]}]}
    with caplog.at_level("WARNING", logger="autobatch"), advice_in_logs(OmegaConf.create({"optimizer": {"lr": 0.5}})):
        warn_replaced_settings(optimizer, saved)
    (message,) = [record.getMessage() for record in caplog.records]
    assert "lr 0.001 (this run: 0.5)" in message
    assert "set them after resuming" not in message
    assert "start afresh without train.resume" in message


def test_review37_a_run_directory_in_use_says_how_to_continue_that_run(tmp_path):
    """``train train.resume=latest hydra.run.dir=RUN`` while RUN still trains was told only to give
    this run its own directory, as if two runs had started in the same second by chance."""
    from autobatch.cli.run_dir import CLAIM, claim_run_dir

    (tmp_path / CLAIM).write_text("1\n")  # pid 1 is alive and not this process
    with pytest.raises(ValueError) as raised:
        claim_run_dir(tmp_path)
    assert "give this run its own hydra.run.dir" in str(raised.value)
    assert "to continue that run, stop it (Ctrl-C saves its checkpoint) or let it end, then give train.resume=latest" \
        in str(raised.value)
