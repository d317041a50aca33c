"""``Runner(micro_batch=plan)``: a Plan from ``autobatch.plan()`` or ``Plan.from_dict`` (or its dict) is
one ``TypeError`` naming ``micro_batch=plan.micro_batch``, and ``plan.apply(model)`` where the plan
checkpoints; it was "must be a positive integer, got Plan(...)" with the whole plan printed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import Runner
from autobatch.planning.plan_result import Plan


def make(**changes):
    fields = dict(global_batch=8, micro_batch=3, accumulation_steps=3, micro_batch_sizes=[3, 3, 2], checkpointing=False,
                  balanced=False)
    return Plan.from_dict({**fields, **changes})


def runner(micro_batch, global_batch=8):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).mean(),
                  global_batch=global_batch, micro_batch=micro_batch, progress=False)


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_plan_passed_as_micro_batch_names_plan_micro_batch(as_dict):
    plan = make()
    with pytest.raises(TypeError, match=r"micro_batch=plan\.micro_batch \(3\)") as info:
        runner(plan.to_dict() if as_dict else plan)
    assert "balanced=False" in str(info.value) and "apply" not in str(info.value)
    assert runner(plan.micro_batch).micro_batch == plan.micro_batch  # what it says to do trains


def test_a_checkpointed_plan_for_another_batch_names_apply_and_its_batch():
    plan = make(checkpointing=True, checkpointed_modules=["0"], global_batch=9, micro_batch_sizes=[3, 3, 3],
                balanced=True)
    with pytest.raises(TypeError, match=r"plan\.apply\(model\) first") as info:
        runner(plan)
    assert "9 samples a step, not global_batch=8" in str(info.value)
