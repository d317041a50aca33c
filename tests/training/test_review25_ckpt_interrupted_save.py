"""A Ctrl-C (or a SIGTERM handler that raises) while ``runner.save()`` writes: the file in place
stays whole, and the runner does not count or name a checkpoint that was never written
(``result.checkpoints_saved`` went up by one and ``result.checkpoint_path`` named a ``last.pt``
that did not exist; the next checkpoint then carried the wrong count)."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner


def _runner(checkpoint_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), global_batch=2,
                  device="cpu", checkpoint_dir=checkpoint_dir, progress=False)


def _interrupted_save(monkeypatch, error):
    real = torch.save

    def half_then_interrupt(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")  # part of the file is on disk when the interrupt comes
        raise error

    monkeypatch.setattr(torch, "save", half_then_interrupt)
    return real


@pytest.mark.parametrize("first", [True, False])
def test_an_interrupted_save_counts_and_names_nothing(tmp_path, monkeypatch, first):
    runner = _runner(tmp_path)
    runner.fit([torch.ones(2, 2)], steps=1)  # writes last.pt at the end of the run
    if first:
        (tmp_path / "last.pt").unlink()
        runner.result.checkpoints_saved, runner.result.checkpoint_path = 0, None
    before = (runner.result.checkpoints_saved, runner.result.checkpoint_path)
    good = None if first else (tmp_path / "last.pt").read_bytes()
    real = _interrupted_save(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        runner.save()
    assert (runner.result.checkpoints_saved, runner.result.checkpoint_path) == before
    assert [p.name for p in tmp_path.iterdir()] == ([] if first else ["last.pt"])  # no torn temporary left
    if not first:
        assert (tmp_path / "last.pt").read_bytes() == good
    monkeypatch.setattr(torch, "save", real)
    runner.save()
    assert runner.result.checkpoints_saved == before[0] + 1
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["result"]["checkpoints_saved"] == before[0] + 1


def test_a_full_disk_mid_save_keeps_the_last_checkpoint_and_latest(tmp_path, monkeypatch):
    runner = _runner(tmp_path)
    runner.fit([torch.ones(2, 2)], steps=1)
    good = (tmp_path / "last.pt").read_bytes()
    _interrupted_save(monkeypatch, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left on device") as caught:
        runner.save()
    assert "last.pt" in str(caught.value) and any("holds the previous checkpoint" in n for n in caught.value.__notes__)
    assert (tmp_path / "last.pt").read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    monkeypatch.undo()
    result = _runner(tmp_path).fit([torch.ones(2, 2)] * 2, steps=2, resume="latest")
    assert result.steps == 2 and result.steps_this_run == 1
