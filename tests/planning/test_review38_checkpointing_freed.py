"""A checkpointed model is freed when the user drops it, not at the garbage collector's next full
collection (review 38). Each wrapped block's forward held its block (block -> forward -> block, a
cycle), so a model dropped without ``undo()`` kept every wrapped block's weights; and a plan kept
after ``undo()`` for its numbers kept the planned model through its handle."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from torch import nn

import autobatch
from autobatch import Plan


def _blocks() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)) for _ in range(3)))


def test_review38_a_checkpointed_model_is_freed_at_del_with_or_without_undo():
    enabled = gc.isenabled()
    gc.disable()  # a collection in between would hide the cycle
    try:
        model = _blocks()
        handle = autobatch.enable_checkpointing(model)
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        twin = copy.deepcopy(model)  # a copy's forwards call the copy's own blocks
        assert twin[0].forward.module is twin[0] and handle.model is model
        block = weakref.ref(model[0])
        del model, handle, twin
        assert block() is None  # dropped without undo()
        model = _blocks()
        plan = Plan(global_batch=4, micro_batch=1, accumulation_steps=4, micro_batch_sizes=[1] * 4,
                    checkpointing=True, checkpointed_modules=["0", "1"])
        plan.handle = autobatch.enable_checkpointing(model, modules=["0", "1"])  # as autobatch.plan() leaves it
        plan.apply(_blocks())
        plan.undo()
        held = weakref.ref(model)
        del model
        assert held() is None and plan.micro_batch == 1  # the plan is kept; the model is not
        plan.undo()  # again: nothing to do
    finally:
        if enabled:
            gc.enable()
