"""Blocks reached under two names, and stages of blocks wrapped whole.

A block shared by two containers (``enc = ModuleList([a, b])``, ``dec = ModuleList([a, b])``: weights tied
across them) was listed by ``find_blocks`` under each name, 4 blocks where the model has 2 (the plan, whose
wrapping takes a module once, named 2). A custom stage class holding a ``ModuleList`` of blocks is wrapped
whole by the automatic rule (its forward may do more than call them); its recompute holds all its blocks'
activations, and where that fitted nothing the error suggested only lower precision or more memory, while
naming the inner class fitted batch 1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.checkpointing import enable_checkpointing, find_blocks
from workloads import Block


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        a, b = Block(), Block()
        self.enc, self.dec, self.head = nn.ModuleList([a, b]), nn.ModuleList([a, b]), nn.Linear(8, 1)

    def forward(self, x):
        for block in [*self.enc, *self.dec]:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Staged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages, self.head = nn.ModuleList([Stage(), Stage()]), nn.Linear(8, 1)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def step(model: nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 128, 8))


def test_review34_a_block_shared_by_two_containers_is_listed_once():
    model = Tied()
    assert find_blocks(model) == ["enc.0", "enc.1"]  # it was enc.0, enc.1, dec.0, dec.1
    assert find_blocks(model, targets=["Block"]) == ["enc.0", "enc.1"]
    handle = enable_checkpointing(model)
    assert handle.modules == find_blocks(model) and model.dec[0].forward is model.enc[0].forward
    handle.undo()
    assert "forward" not in model.dec[0].__dict__


def test_review34_stages_wrapped_whole_that_do_not_fit_name_their_blocks():
    options = dict(global_batch=2, memory_limit="150KiB", strategy="binary", steps_per_trial=1, cache=False)
    with pytest.raises(NoBatchFitsError, match=r"checkpoint_targets=\['Block'\] wraps those instead"):
        plan(step(Staged()), **options)
    # and what it names fits: plan(..., checkpoint_targets=["Block"]) is 1 x 2 with the 4 blocks checkpointed
    # (measured; a second plan() here would double this test's time)
