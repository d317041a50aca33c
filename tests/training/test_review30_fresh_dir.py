"""A run started afresh into a ``checkpoint_dir`` holding another run's checkpoint keeps it.

``Runner(..., checkpoint_dir=D).fit(data)`` without ``resume=`` overwrote the ``last.pt`` an
earlier run left in ``D`` at its first save (a script run again without ``resume=`` lost the
earlier run's progress; only a warning said so). The file is now moved aside to
``last.earlier-<n>.pt`` (never over one kept before), the warning names it, and
``fit(..., resume=<that path>)`` continues the earlier run. A sharded set's files keep their
rank suffix under one number every rank agrees on.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from autobatch import Runner
from autobatch.errors import PeerFailedError
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from autobatch.training.checkpoints.resume_fresh import keep_earlier_run
from autobatch.training.checkpoints.sharded_files import base_path, check_sharded_resume
from runner_workloads import make_data, make_model, mse


def _runner(model, **options) -> Runner:
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.05), mse, global_batch=16, micro_batch=8,
                  progress=False, log_every=None, **options)


def test_a_fresh_run_keeps_the_earlier_runs_checkpoint_and_it_resumes(tmp_path, caplog):
    data = make_data()
    _runner(make_model(), checkpoint_dir=tmp_path).fit(data, steps=2)
    first = (tmp_path / "last.pt").read_bytes()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        _runner(make_model(seed=3), checkpoint_dir=tmp_path).fit(data, steps=1)  # afresh, same folder
    kept = tmp_path / "last.earlier-1.pt"
    assert kept.read_bytes() == first  # the earlier run's bytes, not the new run's
    assert load_checkpoint(tmp_path)["step"] == 1  # the new run's own last.pt
    warned = [r.getMessage() for r in caplog.records if "already holds a checkpoint" in r.getMessage()]
    assert len(warned) == 1 and str(kept) in warned[0] and f"resume={str(kept)!r}" in warned[0]
    resumed = _runner(make_model(seed=4), checkpoint_dir=tmp_path / "resumed")
    result = resumed.fit(data, steps=3, resume=kept)  # the path the warning names
    assert result.resumed_from["step"] == 2 and resumed.step == 3


def test_a_third_fresh_run_never_overwrites_a_kept_checkpoint(tmp_path):
    data = make_data()
    for seed in range(3):
        _runner(make_model(seed=seed), checkpoint_dir=tmp_path).fit(data, steps=seed + 1)
        if seed == 1:
            second = (tmp_path / "last.earlier-1.pt").read_bytes()
    assert (tmp_path / "last.earlier-1.pt").read_bytes() == second  # kept as it was
    assert [load_checkpoint(tmp_path / name)["step"] for name in ("last.earlier-1.pt", "last.earlier-2.pt", "last.pt")] == [1, 2, 3]


class _Ranks:
    """A sharded run's ranks as the runner's ``parallel`` sees them: another rank read a higher
    number (``other``), and moved its file aside or not (``peer_failed``); this process is rank
    ``me`` of 2."""

    def __init__(self, other: int, *, peer_failed: bool = False, me: int = 0) -> None:
        self.other, self.peer_failed, self.me, self.asked, self.votes = other, peer_failed, me, [], []

    def is_rank_zero(self) -> bool:
        return self.me == 0

    def rank(self) -> int:
        return self.me

    def world_size(self) -> int:
        return 2

    def exchange(self, values: list[int], label: str) -> list[list[int]]:
        if "number" not in label:  # the vote that every rank moved its file
            self.votes.append(values[0])
            rows = [list(values), [int(self.peer_failed)]]
        else:
            self.asked.append(values[0])
            rows = [list(values), [self.other]]
        return rows if self.me == 0 else rows[::-1]


def test_a_sharded_file_is_kept_under_the_number_every_rank_agrees_on(tmp_path):
    own = tmp_path / "last.rank0-of-1.pt"  # this process's shard file (rank 0 of 1 without a process group)
    torch.save({"format": "x"}, own)
    written = own.read_bytes()
    (tmp_path / "last.earlier-2.rank1-of-2.pt").write_bytes(b"older")  # an earlier set, kept before
    ranks = _Ranks(other=5)
    keep_earlier_run(tmp_path, ranks, sharded=True)
    kept = tmp_path / "last.earlier-5.rank0-of-1.pt"
    assert ranks.asked == [3] and not own.exists() and kept.read_bytes() == written
    assert (tmp_path / "last.earlier-2.rank1-of-2.pt").read_bytes() == b"older"
    # resume=last.earlier-5.pt (the name the warning gives) reads this rank's file of that set
    assert base_path(kept) == tmp_path / "last.earlier-5.pt"
    assert check_sharded_resume(base_path(kept), sharded=True) == kept


def test_review31_a_save_before_fit_keeps_the_earlier_runs_checkpoint_once(tmp_path, caplog):
    """``runner.save()`` called by hand before any ``fit()`` replaced another run's ``last.pt``
    in its ``checkpoint_dir`` without a word (only fit()'s first save moved it aside)."""
    data = make_data()
    _runner(make_model(), checkpoint_dir=tmp_path).fit(data, steps=2)
    first = (tmp_path / "last.pt").read_bytes()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner = _runner(make_model(seed=3), checkpoint_dir=tmp_path)
        runner.save()  # by hand, before any fit()
        runner.save()  # its own: replaced, nothing moved
        runner.fit(data, steps=1)  # continues this run's dir: nothing moved either
    assert (tmp_path / "last.earlier-1.pt").read_bytes() == first
    assert not (tmp_path / "last.earlier-2.pt").exists() and load_checkpoint(tmp_path)["step"] == 1
    warned = [r.getMessage() for r in caplog.records if "already holds" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "last.earlier-1.pt") in warned[0]


def test_review31_a_run_resumed_from_a_kept_checkpoint_keeps_the_later_runs(tmp_path):
    """A run resumed from ``last.earlier-1.pt`` (the path the warning gives) into the same
    ``checkpoint_dir`` replaced the later run's ``last.pt`` there at its first save."""
    data = make_data()
    _runner(make_model(), checkpoint_dir=tmp_path).fit(data, steps=2)
    _runner(make_model(seed=3), checkpoint_dir=tmp_path).fit(data, steps=1)  # the first kept as last.earlier-1.pt
    later = (tmp_path / "last.pt").read_bytes()
    _runner(make_model(seed=4), checkpoint_dir=tmp_path).fit(data, steps=3, resume=tmp_path / "last.earlier-1.pt")
    assert (tmp_path / "last.earlier-2.pt").read_bytes() == later
    assert [load_checkpoint(tmp_path / name)["step"] for name in ("last.earlier-1.pt", "last.pt")] == [2, 3]


def test_review31_a_move_that_fails_on_one_rank_raises_on_every_rank(tmp_path, monkeypatch):
    """A rank whose move aside failed (a PermissionError) raised alone, and its peers waited
    forever at the save's next sync point: now every rank votes first, and raises one error
    naming the file and what to do; a rank that had moved its file moves it back."""
    own = tmp_path / "last.rank0-of-1.pt"  # this process's shard file (rank 0 of 1 without a process group)
    own.write_bytes(b"earlier run")
    ranks = _Ranks(other=1)  # the peer moved its file, this rank cannot
    real = os.replace

    def refused(source, target):
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PermissionError) as mine:
        keep_earlier_run(tmp_path, ranks, sharded=True)
    assert ranks.votes == [1] and str(own) in mine.value.__notes__[0] and "yourself" in mine.value.__notes__[0]
    monkeypatch.setattr(os, "replace", real)
    ranks = _Ranks(other=1, peer_failed=True)  # this rank moves its file, the peer (rank 1) cannot
    with pytest.raises(PeerFailedError, match=r"rank 1: .*last\.rank1-of-2\.pt.*yourself") as peers:
        keep_earlier_run(tmp_path, ranks, sharded=True)
    assert peers.value.ranks == [1] and own.read_bytes() == b"earlier run"  # moved back: the set is not split
    assert [p.name for p in tmp_path.iterdir()] == [own.name]
    with pytest.raises(PeerFailedError, match=r"rank 0: .*last\.pt"):  # unsharded: rank 0 moves last.pt, rank 1 votes
        keep_earlier_run(tmp_path, _Ranks(other=1, peer_failed=True, me=1), sharded=False)


def test_review31_a_failed_move_writes_nothing_and_the_next_save_tries_again(tmp_path, monkeypatch):
    """One process: a save whose move aside fails leaves the earlier run's file as it was and
    counts no checkpoint; the next save moves it aside, then writes."""
    (tmp_path / "last.pt").write_bytes(b"earlier run")
    runner = _runner(make_model(), checkpoint_dir=tmp_path)
    real = os.replace

    def refused(source, target):
        if "earlier" in str(target):
            raise PermissionError(13, "Permission denied", str(source))
        return real(source, target)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(PermissionError):
        runner.save()
    assert (tmp_path / "last.pt").read_bytes() == b"earlier run" and runner.result.checkpoints_saved == 0
    monkeypatch.setattr(os, "replace", real)
    runner.save()
    assert (tmp_path / "last.earlier-1.pt").read_bytes() == b"earlier run" and load_checkpoint(tmp_path)["step"] == 0


def test_review31_a_save_on_rank_zero_only_leaves_the_earlier_runs_checkpoint_in_place(tmp_path):
    """``if rank == 0: runner.save()`` (a user's mistake) is a ``RankDisagreementError`` at the
    ranks' vote on the move; rank 0 had already renamed the earlier run's ``last.pt`` to
    ``last.earlier-1.pt``, with no warning saying so, and left it there (measured under 2 gloo ranks)."""
    from autobatch.errors import RankDisagreementError

    (tmp_path / "last.pt").write_bytes(b"earlier run")

    class _Elsewhere(_Ranks):
        def exchange(self, values, label):  # rank 1 waits at fit()'s first sync point instead
            raise RankDisagreementError(0, label, {1: "#1 fit(): every rank's arguments"}, "the ranks reached different sync points")

    with pytest.raises(RankDisagreementError):
        keep_earlier_run(tmp_path, _Elsewhere(other=1), sharded=False)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"] and (tmp_path / "last.pt").read_bytes() == b"earlier run"
