"""What a plan tells its user: a model planned in eval mode, and which attempt an accumulated
micro-batch failed in.

The probes noted a model left in eval mode (``model.eval()`` from a validation pass: Dropout off,
BatchNorm on its running statistics, less memory than training mode), but only in their results
inside ``plan.probes``: ``plan.notes`` and ``plan.summary()`` said nothing. Where checkpointing fitted
batch 1 in one step and not beside the first micro-batch's gradients, the error read "up to 1 fits in
one step", as if the plain model had fitted it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from workloads import Block


def step(model: nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 128, 8))


def test_a_model_in_eval_mode_is_planned_as_given_and_the_plan_says_so():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).eval()
    result = plan(step(model), global_batch=4, memory_limit="1MiB", strategy="binary", steps_per_trial=1, cache=False)
    assert not model.training and result.micro_batch_sizes == [4]
    assert any("eval mode" in note for note in result.notes) and "eval mode" in result.summary()
    model.train()
    assert not any("eval mode" in note for note in plan(step(model), global_batch=4, memory_limit="1MiB",
                                                         strategy="binary", steps_per_trial=1, cache=False).notes)


def test_an_accumulated_micro_batch_that_fails_with_checkpointing_says_so():
    model = nn.Sequential(*(Block() for _ in range(4)), nn.Linear(8, 1))
    with pytest.raises(NoBatchFitsError, match="up to 1 fits in one step with activation checkpointing, but not") as info:
        plan(step(model), global_batch=2, memory_limit="126KiB", strategy="binary", steps_per_trial=1, cache=False)
    assert [(a["checkpointing"], a["accumulating"], a["fits"]) for a in info.value.attempts] == [
        (False, False, False), (True, False, True), (True, True, False)]
