"""``train.resume=<run dir>`` of a run made with its own ``train.checkpoint_dir``.

The run directory was looked up with *this* command's ``train.checkpoint_dir``, so a run
trained with ``train.checkpoint_dir=ck`` was "no checkpoint ...; give ... a run directory"
although a run directory was given. The run's own ``train.checkpoint_dir`` is recorded in its
``.hydra/config.yaml`` (and its ``train_result.json``) and is looked in too.
"""

from __future__ import annotations

import json

import pytest

from autobatch.cli.training import find_resume


def _run_with_checkpoint_in(run, checkpoint_dir):
    (run / checkpoint_dir).mkdir(parents=True)
    (run / checkpoint_dir / "last.pt").write_bytes(b"x")
    return run / checkpoint_dir / "last.pt"


def test_a_run_directory_is_resumed_from_the_checkpoint_dir_it_recorded(tmp_path):
    run = tmp_path / "runs" / "C"
    checkpoint = _run_with_checkpoint_in(run, "ck")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("train:\n  checkpoint_dir: ck\n  steps: 2\n")
    assert find_resume("runs/C", "checkpoints", tmp_path) == checkpoint


def test_without_hydras_copy_the_run_result_names_the_checkpoint_dir(tmp_path):
    run = tmp_path / "C"
    checkpoint = _run_with_checkpoint_in(run, "my/ckpts")
    (run / "train_result.json").write_text(json.dumps({"config": {"train": {"checkpoint_dir": "my/ckpts"}}}))
    assert find_resume(str(run), "checkpoints", tmp_path) == checkpoint


def test_a_directory_without_a_checkpoint_names_every_place_it_looked(tmp_path):
    run = tmp_path / "C"
    run.mkdir()
    (run / "train_result.json").write_text(json.dumps({"config": {"train": {"checkpoint_dir": "ck"}}}))
    with pytest.raises(ValueError) as raised:
        find_resume("C", "checkpoints", tmp_path)
    message = str(raised.value)
    assert f"{run / 'checkpoints' / 'last.pt'} or {run / 'ck' / 'last.pt'}" in message
    assert "give a last.pt, its directory or a run directory" in message


def test_an_absolute_checkpoint_dir_the_run_recorded_is_not_taken_for_its_own(tmp_path):
    shared = tmp_path / "shared"
    _run_with_checkpoint_in(tmp_path, "shared")  # every run with train.checkpoint_dir=<shared> writes here
    run = tmp_path / "G"
    run.mkdir()
    (run / "train_result.json").write_text(json.dumps({"config": {"train": {"checkpoint_dir": str(shared)}}}))
    with pytest.raises(ValueError, match="no checkpoint at"):
        find_resume(str(run), "checkpoints", tmp_path)


def test_a_missing_file_is_named_alone(tmp_path):
    with pytest.raises(ValueError) as raised:
        find_resume("gone/last.pt", "checkpoints", tmp_path)
    assert f"no checkpoint at {tmp_path / 'gone' / 'last.pt'};" in str(raised.value)
