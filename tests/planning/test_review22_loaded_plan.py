"""A plan saved as JSON and loaded in the training script: ``apply`` takes the ``TrainStep``
it was planned with (it raised ``'TrainStep' object has no attribute 'named_children'``) and
refuses anything else in one ``TypeError``; training on its split without applying its
checkpointing warns once."""

import json
import warnings

import pytest
import torch
from torch import nn

import autobatch
from autobatch.planning.plan_result import Plan


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], nn.Linear(8, 2))


def _loaded(checkpointing=True):
    plan = Plan(global_batch=6, micro_batch=3, accumulation_steps=2, micro_batch_sizes=[3, 3],
                checkpointing=checkpointing, checkpointed_modules=["0", "1", "2"] if checkpointing else [])
    return Plan.from_dict(json.loads(plan.to_json()))


def test_apply_takes_a_train_step_and_names_what_it_takes():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autobatch.TrainStep(model, opt, lambda m, b: m(b).sum(), lambda n: torch.randn(n, 8))
    plan = _loaded()
    handle = plan.apply(step)
    assert sorted(handle.modules) == ["0", "1", "2"] and "forward" in model[0].__dict__
    plan.undo()
    assert "forward" not in model[0].__dict__
    with pytest.raises(TypeError, match=r"Plan.apply takes the model.*got SGD"):
        plan.apply(opt)


def test_training_on_an_unapplied_plan_warns_once():
    plan = _loaded()
    batch = torch.randn(6, 8)
    with pytest.warns(RuntimeWarning, match=r"plan.apply\(model\)"):
        assert [len(part) for part in plan.split(batch)] == [3, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.split(batch)  # once per plan, not every step
        _loaded(checkpointing=False).split(batch)  # nothing to apply: no warning
        applied = _loaded()
        applied.apply(_model())
        applied.split(batch)
