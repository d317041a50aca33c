"""Sharded (FSDP2) checkpoint files in one process: names, and the one-line errors of a resume
that does not match the set on disk (the two-rank resume itself is in tests/distributed/test_fsdp.py)."""

from __future__ import annotations

import pytest

from autobatch.errors import CheckpointError
from autobatch.training.checkpoints.sharded_files import base_path, check_sharded_resume, sharded_path, sharded_sets


def _write(directory, *names):
    for name in names:
        (directory / name).write_bytes(b"x")


def test_a_rank_file_is_named_after_the_checkpoint_and_the_world(tmp_path):
    assert sharded_path(tmp_path / "last.pt", 1, 2).name == "last.rank1-of-2.pt"
    assert sharded_path(tmp_path, 0, 4) == tmp_path / "last.rank0-of-4.pt"  # a directory: its last.pt
    assert base_path(tmp_path / "last.rank1-of-2.pt") == tmp_path / "last.pt"
    _write(tmp_path, "last.rank0-of-2.pt", "last.rank1-of-2.pt", "last.rank0-of-4.pt", "other.rank0-of-2.pt")
    assert sharded_sets(tmp_path / "last.pt") == {2: [0, 1], 4: [0]}


def test_a_resume_under_another_world_size_says_how_many_ranks(tmp_path):
    _write(tmp_path, "last.rank0-of-2.pt", "last.rank1-of-2.pt")
    with pytest.raises(CheckpointError, match=r"sharded over 2 ranks and this job has 1: .* torchrun --nproc-per-node 2"):
        check_sharded_resume(tmp_path, sharded=True)  # no process group: one rank


def test_a_sharded_set_without_fsdp_and_a_plain_checkpoint_with_it_say_what_to_change(tmp_path):
    _write(tmp_path, "last.rank0-of-2.pt", "last.rank1-of-2.pt")
    with pytest.raises(CheckpointError, match=r"fully_shard it before Runner\(\.\.\.\); from the command line, train.fsdp=true\) under torchrun --nproc-per-node 2"):
        check_sharded_resume(tmp_path / "last.pt", sharded=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    _write(plain, "last.pt")
    assert check_sharded_resume(plain, sharded=False) == plain / "last.pt"
    with pytest.raises(CheckpointError, match=r"no fully_shard before Runner\(...\); from the command line, without train.fsdp"):
        check_sharded_resume(plain, sharded=True)


def test_an_incomplete_set_is_refused_on_every_rank(tmp_path, monkeypatch):
    import autobatch.training.checkpoints.sharded_files as sharded_files

    monkeypatch.setattr(sharded_files, "_rank_world", lambda: (0, 2))  # rank 0 of 2
    _write(tmp_path, "last.rank0-of-2.pt")  # rank 1's file is missing: rank 0 must not go on alone
    with pytest.raises(CheckpointError, match=r"incomplete \(no file for ranks \[1\]\)"):
        check_sharded_resume(tmp_path, sharded=True)
    _write(tmp_path, "last.rank1-of-2.pt")
    assert check_sharded_resume(tmp_path / "last.rank1-of-2.pt", sharded=True) == tmp_path / "last.rank0-of-2.pt"
