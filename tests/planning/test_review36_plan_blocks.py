"""Blocks the planner cannot see, and what a plan's summary says it checkpointed.

Blocks held in a plain Python list attribute (``self.blocks = [Block() for _ in range(4)]``) are not registered:
no checkpointing can reach them, nor ``model.parameters()``. The error of a plan that needed checkpointing said
"activation checkpointing cannot help this model", and ``checkpoint_targets=['Block']`` listed the model's classes
as if the name were misspelt; neither named the list.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import TrainStep, plan
from autobatch.planning.checkpointing import no_blocks_hint
from autobatch.planning.plan_result import Plan
from workloads import Block


class Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.head = [Block() for _ in range(4)], nn.Linear(8, 1)  # a plain list: not registered
        self._teacher = [nn.Linear(8, 1)]  # one module kept off state_dict on purpose: no block

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_review36_blocks_in_a_plain_list_are_named_with_the_fix():
    model = Listed()
    hint = no_blocks_hint(model)
    assert "plain Python attributes (blocks: a list of 4 modules, Block)" in hint and "nn.ModuleList" in hint
    assert "cannot help" not in hint and "_teacher" not in hint
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 8))
    with pytest.raises(ValueError, match=r"match no module .*blocks: a list of 4 modules, Block.*nn\.ModuleList"):
        plan(step, global_batch=2, memory_limit="1MiB", checkpoint_targets=["Block"])  # before any probe


def test_review36_summary_counts_one_checkpointed_module_in_the_singular():
    text = Plan(global_batch=4, micro_batch=1, accumulation_steps=4, micro_batch_sizes=[1] * 4, checkpointing=True,
                checkpointed_modules=["blk"]).summary()
    assert "on, 1 module (blk)" in text  # it read "1 modules"
