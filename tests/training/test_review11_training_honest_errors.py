"""Review 11: what the runner reports where an OOM or a checkpoint write does not go as planned.

* An OOM raised after a step's attempts succeeded (in ``scheduler.step()``) is outside the
  runner's replay: its ``StepOutOfMemoryError`` says so, instead of claiming that the smallest
  micro-batch ran out, and the step is undone.
* A checkpoint that fails to write is not counted in ``result.checkpoints_saved``, nor named
  by ``result.checkpoint_path``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import autobatch.training.checkpoints.resume as resume_module
from autobatch import Runner, StepOutOfMemoryError
from runner_workloads import make_data, make_model, mse, weights


class FailingScheduler(torch.optim.lr_scheduler.StepLR):
    """A StepLR whose ``fail_at``-th ``step()`` call raises an out-of-memory error."""

    fail_at = 3

    def __init__(self, *args, **kwargs) -> None:
        self.calls = 0
        super().__init__(*args, **kwargs)

    def step(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at + 1:  # the constructor's step() is call 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return super().step(*args, **kwargs)


def _runner(scheduler_cls=torch.optim.lr_scheduler.StepLR, **options):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = scheduler_cls(optimizer, step_size=1, gamma=0.9)
    options = {"global_batch": 16, "micro_batch": 8, "progress": False, **options}
    return Runner(model, optimizer, mse, scheduler=scheduler, **options)


@pytest.mark.parametrize("micro_batch", [1, 8])
def test_oom_in_scheduler_says_where_it_struck(micro_batch):
    runner = _runner(FailingScheduler, micro_batch=micro_batch)
    with pytest.raises(StepOutOfMemoryError) as caught:
        runner.fit(make_data(64, 16), epochs=1)
    message = str(caught.value)
    assert "scheduler.step()" in message and "outside the runner's OOM replay" in message
    assert "smallest" not in message and "nothing smaller" not in message
    assert caught.value.phase == "scheduler" and caught.value.step == 2
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert runner.result.oom_recoveries == []  # nothing was replayed
    # the step was undone: weights and scheduler are those of a run that stopped after 2 steps
    reference = _runner(micro_batch=micro_batch)
    reference.fit(make_data(64, 16), steps=2)
    assert runner.step == 2
    for mine, theirs in zip(weights(runner.model), weights(reference.model), strict=True):
        assert torch.equal(mine, theirs)
    assert runner.scheduler.last_epoch == reference.scheduler.last_epoch == 2


def test_oom_in_replay_still_names_the_smallest_micro_batch():
    """The honest message of an OOM the replay ran out of options for is unchanged."""
    from autobatch import inject_oom

    runner = _runner(micro_batch=1)
    inject_oom(runner, at=[(1, "forward")], times=None)
    with pytest.raises(StepOutOfMemoryError, match="at micro-batch 1 without activation checkpointing; nothing "
                                                   "smaller is left to try") as caught:
        runner.fit(make_data(64, 16), epochs=1)
    assert caught.value.phase == "forward"


def test_failed_checkpoint_write_is_not_counted(tmp_path, monkeypatch):
    runner = _runner(checkpoint_dir=tmp_path, checkpoint_every=2)
    written = resume_module.save_checkpoint
    calls = []

    def disk_full_on_second(state, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return written(state, path)

    monkeypatch.setattr(resume_module, "save_checkpoint", disk_full_on_second)
    with pytest.raises(OSError, match="No space left"):
        runner.fit(make_data(64, 16), epochs=1)
    assert runner.result.checkpoints_saved == 1  # the first checkpoint only: the second was never written
    assert runner.result.checkpoint_path == str(tmp_path / "last.pt")
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["step"] == 2 and saved["result"]["checkpoints_saved"] == 1


def test_unstorable_checkpoint_is_not_counted(tmp_path):
    runner = _runner()
    runner.fit(make_data(32, 16), epochs=1)
    runner.optimizer.param_groups[0]["extra"] = np.array([1.0])  # no weights-only load reads it back
    with pytest.raises(TypeError, match="numpy"):
        runner.save(tmp_path / "first.pt")
    assert runner.result.checkpoints_saved == 0 and runner.result.checkpoint_path is None
    del runner.optimizer.param_groups[0]["extra"]
    runner.save(tmp_path / "second.pt")
    assert runner.result.checkpoints_saved == 1 and runner.result.checkpoint_path == str(tmp_path / "second.pt")


def test_a_failed_grow_back_try_is_recorded_as_back():
    """A grow-back try that runs out of memory goes back to the size that trained: its recovery
    said ``action="halve"`` though nothing was halved (8 -> 16 failed, back to 8)."""
    from autobatch import inject_oom

    runner = _runner(micro_batch=8, grow_after=1, max_micro_batch=16)
    inject_oom(runner, at=[(1, "forward")], times=1)  # step 1 is the first grow-back try, at 16
    result = runner.fit(make_data(64, 16), epochs=1)
    recovery = result.oom_recoveries[0]
    assert (recovery["grow"], recovery["micro_batch_before"], recovery["micro_batch"]) == (True, 16, 8)
    assert recovery["action"] == "back"
