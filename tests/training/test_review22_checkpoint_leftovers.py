"""Review 22: what a writer killed mid-save leaves in ``checkpoint_dir``.

``save_checkpoint`` writes ``.last.pt.tmp-<pid>`` and renames it over ``last.pt``; a process
killed mid-write left that file, as large as a checkpoint, and no later save (another pid)
ever removed it: one more for every run killed while it saved. A resume from a folder holding
only such a file said "no checkpoint" without naming it. ``checkpoint_dir="run/last.pt"`` made a
folder ``last.pt`` holding ``last.pt``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint, save_checkpoint

GONE = 4194305  # above Linux's largest pid_max (2**22): no process has it


def test_a_save_removes_a_killed_writers_temporary_and_keeps_a_live_ones(tmp_path):
    killed, live = tmp_path / f".last.pt.tmp-{GONE}", tmp_path / f".last.pt.tmp-{os.getppid()}"
    killed.write_bytes(b"PK\x03\x04 half a checkpoint")
    live.write_bytes(b"PK\x03\x04 being written")
    save_checkpoint({"step": 3}, tmp_path / "last.pt")
    assert not killed.exists() and live.exists()  # the running writer's file is its own to rename
    assert load_checkpoint(tmp_path)["step"] == 3


def test_a_resume_from_only_an_interrupted_write_names_it(tmp_path):
    (tmp_path / f".last.pt.tmp-{GONE}").write_bytes(b"PK\x03\x04 half a checkpoint")
    with pytest.raises(FileNotFoundError, match=rf"\.last\.pt\.tmp-{GONE} there is a write that was interrupted"):
        load_checkpoint(tmp_path)
    assert (tmp_path / f".last.pt.tmp-{GONE}").exists()  # a resume deletes nothing


def test_a_checkpoint_dir_that_names_a_file_is_one_error(tmp_path):
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match=r"names a file: .*pass checkpoint_dir="):
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).mean(), global_batch=4,
               checkpoint_dir=tmp_path / "run" / "last.pt")
    assert not (tmp_path / "run").exists()
