"""Review 35: a checkpoint save that fails, or a process stopped inside one, loses nothing.

* A fresh run's first save into a ``checkpoint_dir`` holding another run's ``last.pt`` moves that
  file aside to ``last.earlier-<n>.pt`` before it writes. Where the write then failed (a full
  disk, an interrupt) the folder was left with no ``last.pt``: ``resume="latest"`` said none was
  written, and the error said ``last.pt`` "holds the previous checkpoint". Now it is moved back.
* A full disk named neither the room a checkpoint needs nor what the folder has free.
* A process killed inside that first save leaves only ``last.earlier-<n>.pt``: the resume's error
  named only the missing ``last.pt``. Now it names the kept file and the ``resume=`` for it.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint

DATA = [torch.ones(2, 2)] * 4


def _runner(checkpoint_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), global_batch=2,
                  micro_batch=2, device="cpu", checkpoint_dir=checkpoint_dir, checkpoint_every=1, progress=False)


def _failing_save(monkeypatch, error):
    def half_then_fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 part of a checkpoint")  # part of the file is written when the error comes
        raise error

    monkeypatch.setattr(torch, "save", half_then_fail)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_review35_a_failed_first_save_puts_the_earlier_runs_checkpoint_back(tmp_path, monkeypatch, error):
    _runner(tmp_path).fit(DATA, steps=2)
    good = (tmp_path / "last.pt").read_bytes()
    fresh = _runner(tmp_path)
    _failing_save(monkeypatch, error)
    with pytest.raises(type(error)):
        fresh.fit(DATA, steps=1)
    assert os.listdir(tmp_path) == ["last.pt"] and (tmp_path / "last.pt").read_bytes() == good
    monkeypatch.undo()
    fresh.save()  # once there is room: the earlier run's checkpoint is moved aside again, then this one written
    assert (tmp_path / "last.earlier-1.pt").read_bytes() == good and load_checkpoint(tmp_path)["step"] == 1


def test_review35_a_full_disk_says_the_room_a_checkpoint_needs(tmp_path, monkeypatch):
    runner = _runner(tmp_path)
    runner.fit(DATA, steps=1)
    size = (tmp_path / "last.pt").stat().st_size
    _failing_save(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError) as caught:
        runner.fit(DATA, steps=2)
    room = [note for note in caught.value.__notes__ if "free" in note]
    assert len(room) == 1 and str(tmp_path) in room[0] and "(the previous checkpoint's size)" in room[0], room
    assert f"{size}.00 B" in room[0] or f"{size / 1024:.2f} KiB" in room[0]


def test_review35_a_resume_names_the_checkpoint_a_killed_first_save_kept_aside(tmp_path):
    _runner(tmp_path).fit(DATA, steps=2)
    os.replace(tmp_path / "last.pt", tmp_path / "last.earlier-1.pt")  # what a kill inside the next run's first save leaves
    kept = str(tmp_path / "last.earlier-1.pt")
    with pytest.raises(ValueError, match=rf"no last\.pt written there; the folder holds last\.earlier-1\.pt.*{kept}"):
        _runner(tmp_path).fit(DATA, steps=3, resume="latest")
    with pytest.raises(FileNotFoundError, match=rf"the folder holds last\.earlier-1\.pt.*resume='{kept}'"):
        _runner(tmp_path).fit(DATA, steps=3, resume=tmp_path)
    assert _runner(tmp_path).fit(DATA, steps=3, resume=kept).steps_this_run == 1
