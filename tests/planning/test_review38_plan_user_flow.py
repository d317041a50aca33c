"""Review 38: what a plan tells a user about blocks it cannot, or need not, checkpoint.

Blocks in a plain Python list are not registered: the optimizer built from ``model.parameters()`` does not train
them and ``.double()`` leaves them behind. Only a plan that tried checkpointing named them; one that fitted without it
said nothing. A model that checkpoints itself (Transformers' ``gradient_checkpointing_enable()``) and fits nothing got
an error saying so twice, in two wordings.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.planner import _Planner
from workloads import Block


class Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.head = [Block() for _ in range(3)], nn.Linear(8, 1)  # a plain list: not registered

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _step(model: nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 8))


def test_review38_a_plan_that_fits_names_blocks_in_a_plain_list(caplog):
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        result = plan(_step(Listed()), global_batch=4, memory_limit="64MiB", steps_per_trial=1)
    assert result.accumulation_steps == 1 and not result.checkpointing
    named = [note for note in result.notes if "blocks: a list of 3 modules, Block" in note]
    assert len(named) == 1 and "nn.ModuleList" in named[0] and "does not train them" in named[0]
    assert any("blocks: a list of 3 modules" in record.getMessage() for record in caplog.records)


class SelfCheckpointed(nn.Module):
    """A model whose blocks checkpoint themselves, as Transformers' flag says."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block() for _ in range(3))
        for block in self.h:
            block.gradient_checkpointing = True

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


def test_review38_a_model_that_checkpoints_itself_is_told_so_once():
    model = SelfCheckpointed()
    planner = _Planner(_step(model), 4, 4, None, {"memory_limit": "1KiB"})
    assert planner.own() and not planner.wrap()  # nothing wrapped: the note names the model's own checkpointing
    plain = NoBatchFitsError(1, 1024, 2048, "cpu")  # what the plain probe raised
    text = str(planner.no_fit(plain, None, True))
    assert text.count("checkpoints its own blocks already") == 1, text
    assert "gradient_checkpointing_disable()" in text
