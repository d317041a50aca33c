"""Review 33: what a real machine's failures do to the runner's checkpoints.

* Two runs writing into one ``checkpoint_dir`` at once: the second's first save kept the first's
  ``last.pt`` aside, and the first's next save then replaced the second's, silently: that run's
  progress was lost. Now the first leaves it alone, writes its own to ``last.earlier-<n>.pt`` and
  stops with one ``ValueError`` naming it.
* An empty ``last.pt`` (a copy cut short, a crash before the file system wrote it) was "not an
  autobatch checkpoint (not a file torch.save writes); resume from the last.pt autobatch's runner
  wrote": it was that file. Now it says it is empty.
* A save refused for permission said "once there is room, runner.save() writes it".
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from autobatch import Runner
from autobatch.errors import CheckpointError
from autobatch.training.checkpoints import checkpoint_io
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint, written_by_torch_save


def _runner(checkpoint_dir, optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return Runner(model, optimizer(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), global_batch=2,
                  device="cpu", checkpoint_dir=checkpoint_dir, checkpoint_every=1, progress=False)


DATA = [torch.ones(2, 2)] * 4


def test_review33_two_runs_sharing_a_checkpoint_dir_never_replace_each_other(tmp_path):
    first, second = _runner(tmp_path), _runner(tmp_path, torch.optim.Adam)
    first.fit(DATA, steps=2)
    second.fit(DATA, steps=1)  # its first save keeps the first run's last.pt as last.earlier-1.pt
    theirs = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(ValueError, match=r"written by another run too.*step 3 is written to .*last\.earlier-2\.pt"):
        first.fit(DATA, steps=4)
    assert (tmp_path / "last.pt").read_bytes() == theirs  # the second run's, not replaced
    assert load_checkpoint(tmp_path / "last.earlier-2.pt")["step"] == 3  # the first run's progress
    second.fit(DATA, steps=2)  # the second run goes on in its last.pt
    assert load_checkpoint(tmp_path)["step"] == 2 and load_checkpoint(tmp_path)["optimizer_type"] == "Adam"
    resumed = _runner(tmp_path / "own")
    resumed.fit(DATA, steps=4, resume=tmp_path / "last.earlier-2.pt")
    assert resumed.result.resumed_from["step"] == 3 and load_checkpoint(tmp_path / "own")["step"] == 4


def test_review33_an_empty_checkpoint_is_said_to_be_empty(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"")
    assert written_by_torch_save(tmp_path / "last.pt")  # the command line's check leaves it to the load
    with pytest.raises(CheckpointError, match=r"last\.pt: it is empty \(0 bytes\).*resume from an earlier checkpoint"):
        _runner(tmp_path).fit(DATA, steps=1, resume=tmp_path)


def test_review33_a_save_refused_for_permission_says_what_to_change(tmp_path, monkeypatch):
    runner = _runner(tmp_path)
    runner.fit(DATA, steps=1)
    good = (tmp_path / "last.pt").read_bytes()

    def denied(source, target):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    monkeypatch.setattr(checkpoint_io.os, "replace", denied)
    with pytest.raises(PermissionError) as caught:
        runner.fit(DATA, steps=2)
    notes = " ".join(caught.value.__notes__)
    assert "step 2 is trained and counted" in notes and "checkpoint_dir is writable again" in notes
    assert "there is room" not in notes
    assert (tmp_path / "last.pt").read_bytes() == good and os.listdir(tmp_path) == ["last.pt"]


def test_review33_a_rank_that_writes_no_file_never_takes_rank_zeros_saves_for_another_runs(tmp_path):
    """Under DDP rank 0 alone writes ``last.pt``; a peer resumed from it must not remember that
    file as its own, or rank 0's next save looked, on the peer, like another run's (every rank
    then stopped with the shared-directory error at the second save after a resume)."""
    zero = _runner(tmp_path)
    zero.fit(DATA, steps=1)
    peer = _runner(tmp_path)
    peer._parallel.is_rank_zero = lambda: False  # writes nothing, as rank 1 of a DDP job
    peer.fit(DATA, steps=2, resume=tmp_path)
    zero.fit(DATA, steps=2)  # rank 0's save of the same step
    peer.fit(DATA, steps=3)  # its save after rank 0 replaced last.pt: not another run's
    assert peer.step == 3 and load_checkpoint(tmp_path)["step"] == 2
