"""A split with a micro-batch of one sample, for a model with BatchNorm in training.

Global batch 9 where 2 fit was planned 2, 2, 2, 2, 1 (15 unbalanced where 7 fit: 7, 7, 1); the probes
stop above batch 1, so no trial ever ran one sample, and training the plan failed at its last
micro-batch with BatchNorm's "Expected more than 1 value per channel when training". The planner
now tries batch 1 where such a plan has it, so the error comes from plan(), naming what to change.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from autobatch import TrainStep, plan


def bn_step() -> TrainStep:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4096), nn.BatchNorm1d(4096), nn.ReLU(), nn.Linear(4096, 1))
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 4))


@pytest.mark.filterwarnings("ignore:plan")
@pytest.mark.parametrize("global_batch, memory_limit, balanced, fix", [
    (9, "325KiB", True, r"an even global batch \(8 or 10\) with multiple_of=2"),
    (15, "610KiB", False, r"balanced=True \(micro-batches 5, 5, 5\)"),
])
def test_a_one_sample_micro_batch_bn_cannot_train_fails_in_plan_naming_the_fix(global_batch, memory_limit, balanced, fix):
    step = bn_step()
    options = dict(memory_limit=memory_limit, strategy="binary", start=4, steps_per_trial=1, cache=False)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as info:
        plan(step, global_batch=global_batch, balanced=balanced, **options)
    note = info.value.__notes__[-1]
    assert "the last of a single sample" in note and re.search(fix, note)
    # the split the note names plans, and trains
    assert plan(step, global_batch=global_batch - 1 if balanced else global_batch, balanced=True,
                **options).micro_batch_sizes in ([2, 2, 2, 2], [5, 5, 5])


@pytest.mark.filterwarnings("ignore:plan")
def test_throughput_times_no_one_sample_candidate_for_batch_norm_unless_nothing_else_is_left():
    """The smallest candidate is largest // 16, 1 below 32: a global batch of 8 that fitted in one
    step raised BatchNorm's error from timing 1 x 8, though 8, 4 x 2 and 2 x 4 train."""
    step = bn_step()
    options = dict(strategy="binary", start=4, steps_per_trial=1, cache=False, objective="throughput",
                   warmup_steps=0, timed_steps=1, retime_rounds=0)
    result = plan(step, global_batch=8, memory_limit="1500KiB", **options)
    assert sorted(c["micro_batch"] for c in result.candidates) == [2, 4, 8]
    assert any(note.startswith("not timed: 1 x 8") for note in result.notes)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as info:
        plan(step, global_batch=9, memory_limit="325KiB", **options)  # every candidate has one: 2 x 5 and 1 x 9
    assert "an even global batch (8 or 10) with multiple_of=2" in info.value.__notes__[-1]
