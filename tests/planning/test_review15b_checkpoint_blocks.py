"""Which blocks checkpointing wraps in models laid out otherwise than one Sequential/ModuleList of blocks.

A Sequential of Sequential stages was wrapped stage by stage, whose recompute holds all the
stage's blocks' activations again (2 stages of 12 blocks: batch 3 fitted, 8 with the blocks
wrapped); blocks in an ``nn.ModuleDict`` were not found; blocks held as attributes
(``self.enc``, ``self.mid``, ...) got "name the block classes in checkpoint_targets" naming
none, and a model of one giant layer was told the same, where checkpointing cannot help.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.checkpointing import find_blocks, no_blocks_hint


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = block()

    def forward(self, x):
        return self.body(x) + x


class Named(nn.Module):
    """Blocks held as attributes: no container to find them in."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.dec = Blk(), Blk(), Blk()

    def forward(self, x):
        return self.dec(self.mid(self.enc(x)))


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.experts = nn.Linear(8, 8), nn.ModuleList(block() for _ in range(4))

    def forward(self, x):
        return sum(expert(self.attn(x)) for expert in self.experts)


def test_the_blocks_of_sequential_stages_are_wrapped_not_the_stages():
    stages = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), *(block() for _ in range(3))) for _ in range(2)))
    assert find_blocks(stages) == ["0.1", "0.2", "0.3", "1.1", "1.2", "1.3"]  # the stages' single Linear stays
    # a custom layer's forward may do more than its entries: the layers of a MoE model are wrapped, not its experts
    assert find_blocks(nn.ModuleList(MoELayer() for _ in range(2))) == ["0", "1"]
    # a Sequential holding another kind of block once is no stage of blocks: wrapped whole
    mixed = nn.Sequential(*(nn.Sequential(block(), block(), nn.LSTM(8, 8)) for _ in range(2)))
    assert find_blocks(mixed) == ["0", "1"]


def test_blocks_of_a_module_dict_are_found():
    model = nn.Module()
    model.blocks = nn.ModuleDict({f"b{i}": Blk() for i in range(3)})
    assert find_blocks(model) == ["blocks.b0", "blocks.b1", "blocks.b2"]


def test_no_blocks_found_names_the_classes_to_target_or_says_checkpointing_cannot_help():
    model = Named()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 256, 8))
    with pytest.raises(NoBatchFitsError, match=r"checkpoint_targets=\['Blk'\] \(repeated classes of the model: Blk \(3\)"):
        plan(step, global_batch=4, memory_limit="40KiB", steps_per_trial=1, cache=False)
    giant = nn.Sequential(nn.Linear(8, 4096), nn.ReLU(), nn.Linear(4096, 8))
    assert "checkpointing cannot help this model" in no_blocks_hint(giant)
