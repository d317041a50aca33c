"""A recovery that shrinks the micro-batch below what the model can train (BatchNorm at 1):
the model's error propagates with a note saying why, ``min_micro_batch`` keeps the recovery
above it, and a step given up leaves the micro-batch it began with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autobatch
from autobatch import Runner, StepOutOfMemoryError
from runner_workloads import make_data, make_model, mse

FEATURES = 6


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 1)).double()


def _bn_runner(micro_batch: int = 2, **options) -> Runner:
    model = _bn_model()
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=micro_batch,
                  progress=False, grow_after=None, **options)


def test_an_error_at_a_micro_batch_a_recovery_shrank_gets_a_note():
    """An OOM at micro-batch 2 halved it to 1 and BatchNorm's ValueError ended the run with
    nothing to say that the recovery's smaller size was the cause."""
    runner = _bn_runner(micro_batch=2)
    autobatch.inject_oom(runner, at=[(1, "backward")], times=1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        runner.fit(make_data(), epochs=1)
    note = "\n".join(caught.value.__notes__)
    assert "micro-batch 1 in global step 1" in note and "out-of-memory error at micro-batch 2 (step 1)" in note
    assert "Runner(min_micro_batch=2)" in note and "checkpointing_fallback=True" in note
    assert runner.step == 1 and runner.micro_batch == 2  # the step undone, at the size it began with


def test_the_note_names_the_piece_that_failed_where_the_split_leaves_a_shorter_one():
    """16 by a shrunk micro-batch of 3 is 3, 3, 3, 3, 3, 1 (unbalanced): BatchNorm fails on the
    piece of 1, and the note says so and suggests a floor above it, not above 3."""
    runner = _bn_runner(micro_batch=6, balanced=False)
    autobatch.inject_oom(runner, at=[(1, "backward")], times=1)  # 6 -> 3 (halved: no memory measured)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        runner.fit(make_data(), epochs=1)
    note = "\n".join(caught.value.__notes__)
    assert "micro-batch 3 (its smallest piece: 1 sample)" in note and "Runner(min_micro_batch=2)" in note


def test_an_error_at_a_size_that_trained_gets_no_note():
    model = make_model()
    calls = []

    def loss_fn(m, batch):
        calls.append(len(batch[0]))
        if len(calls) > 6:
            raise KeyError("a bug in loss_fn")
        return mse(m, batch)

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=16, micro_batch=8,
                    progress=False, grow_after=None)
    autobatch.inject_oom(runner, at=[(0, "backward")], times=1)  # 8 -> 4 at step 0, which then trains at 4
    with pytest.raises(KeyError) as caught:
        runner.fit(make_data(), epochs=1)
    assert not getattr(caught.value, "__notes__", None)


def test_min_micro_batch_keeps_the_recovery_above_it():
    runner = _bn_runner(micro_batch=8, min_micro_batch=2)
    autobatch.inject_oom(runner, at=[(1, "backward")], times=2)  # 8 -> 4 -> 2, never 1
    result = runner.fit(make_data(), epochs=1)
    assert [(r["micro_batch_before"], r["micro_batch"]) for r in result.oom_recoveries] == [(8, 4), (4, 2)]
    assert result.steps == 3

    runner = _bn_runner(micro_batch=2, min_micro_batch=2)
    autobatch.inject_oom(runner, at=[(1, "forward")], times=None)
    with pytest.raises(StepOutOfMemoryError, match=r"at micro-batch 2, the smallest min_micro_batch=2 allows"):
        runner.fit(make_data(), epochs=1)
    assert runner.micro_batch == 2

    runner = _bn_runner(micro_batch=2, min_micro_batch=2, checkpointing_fallback=True, checkpoint_targets=["Linear"])
    autobatch.inject_oom(runner, at=[(1, "backward")], times=1)
    result = runner.fit(make_data(), epochs=1)
    assert result.oom_recoveries[0]["action"] == "checkpointing" and result.oom_recoveries[0]["micro_batch"] == 2


@pytest.mark.parametrize("options, message", [
    ({"min_micro_batch": 0}, "min_micro_batch must be a positive integer"),
    ({"min_micro_batch": 32}, r"min_micro_batch=32 is above the global batch per rank \(16\)"),
    ({"min_micro_batch": 4, "micro_batch": 2}, r"min_micro_batch=4 is above micro_batch \(2\)"),
    ({"min_micro_batch": 4, "max_micro_batch": 2}, r"min_micro_batch=4 is above max_micro_batch \(2\)"),
])
def test_a_bad_min_micro_batch_is_one_clear_error(options, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, **options)


def test_a_step_given_up_leaves_the_micro_batch_it_began_with():
    """_abandon said it restored the micro-batch; after StepOutOfMemoryError it stayed at 1."""
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=4,
                    progress=False, grow_after=None)
    autobatch.inject_oom(runner, at=[(1, "forward")], times=None)
    with pytest.raises(StepOutOfMemoryError):
        runner.fit(make_data(), epochs=1)
    assert runner.micro_batch == 4 and runner.step == 1
    runner.faults = None
    result = runner.fit(make_data(), epochs=1)
    assert result.steps == 3 and result.micro_batch == 4


def test_a_planned_micro_batch_below_the_floor_is_raised_to_it(caplog):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, progress=False,
                    min_micro_batch=4, plan_options={"max_batch": 2, "cache": False})
    result = runner.fit(make_data(), steps=1)
    assert result.micro_batch == 4 and "below min_micro_batch=4" in caplog.text
