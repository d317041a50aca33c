"""Review 37: the planning API as a user drives it (plan, apply to a copy, undo)."""

import copy

import torch
from torch import nn

import autobatch
from autobatch.planning.checkpointing import is_checkpointed


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])


def test_review37_apply_to_copy_of_wrapped_model_is_undone():
    """A deepcopy of a checkpointed model carries the wrapping over: Plan.apply on the copy returned an empty
    handle and plan.undo() left the copy checkpointed, with no handle that could unwrap it."""
    model = _model()
    plan = autobatch.Plan(global_batch=4, micro_batch=2, accumulation_steps=2, micro_batch_sizes=[2, 2],
                          checkpointing=True, checkpointed_modules=["0", "1", "2"])
    plan.handle = autobatch.enable_checkpointing(model)
    assert plan.handle.modules == ["0", "1", "2"]
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(twin[i]) for i in range(3))
    handle = plan.apply(twin)
    assert handle.modules == ["0", "1", "2"]
    assert plan.apply(twin).modules == []  # applied twice: the first handle owns it
    plan.undo()
    assert not any(is_checkpointed(block) for block in [*model, *twin])
    with autobatch.enable_checkpointing(copy.deepcopy(plan.apply(model).model)) as own:  # the copy's own handle
        assert own.modules == ["0", "1", "2"]
    assert not any(is_checkpointed(block) for block in own.model)
    x = torch.randn(3, 4)
    twin(x).sum().backward()  # still trains, plainly
