"""Blocks whose weights are shared across positions, under activation checkpointing.

``nn.ModuleList([block] * 4)`` (one layer's weights at every position, a universal transformer)
was counted as one entry, since ``named_children`` yields a shared module once: no block was
found, and the plan's error said checkpointing could not help. ALBERT-style models call one
``self.layer`` in a loop; no class repeats there, and the hint said "checkpointing cannot help this
model", where naming the layer fits batch 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.checkpointing import enable_checkpointing, find_blocks, no_blocks_hint
from workloads import Block


class SharedList(nn.Module):
    """One block's weights at every position of a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        block = Block()
        self.blocks, self.head = nn.ModuleList([block] * 4), nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Looped(SharedList):
    """ALBERT-style: one layer held once, applied four times."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = self.blocks[0]
        del self.blocks

    def forward(self, x):
        for _ in range(4):
            x = self.layer(x)
        return self.head(x)


def step(model: nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 128, 8))


def test_a_block_shared_by_the_entries_of_a_container_is_wrapped_and_its_gradients_kept():
    assert find_blocks(SharedList()) == ["blocks.0"]
    block = Block()
    assert find_blocks(nn.Sequential(nn.Sequential(block, block), nn.Sequential(block, block))) == ["0.0"]  # one module
    torch.manual_seed(0)
    model = SharedList().double()
    wrapped, x = copy.deepcopy(model), torch.randn(3, 5, 8, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    assert enable_checkpointing(wrapped).modules == ["blocks.0"]
    wrapped(x).pow(2).mean().backward()
    for plain, checkpointed in zip(model.parameters(), wrapped.parameters()):
        torch.testing.assert_close(checkpointed.grad, plain.grad, rtol=0, atol=1e-12)
    # batch 1 fits only with the shared block checkpointed (it failed: "checkpointing cannot help this model")
    model = SharedList()
    result = plan(step(model), global_batch=2, memory_limit="150KiB", strategy="binary", steps_per_trial=1, cache=False)
    assert (result.micro_batch_sizes, result.checkpointed_modules) == ([1, 1], ["blocks.0"])
    result.undo()


def test_a_layer_applied_in_a_loop_is_named_to_target_not_called_hopeless():
    hint = no_blocks_hint(Looped())
    assert "checkpoint_targets=['Block']" in hint and "cannot help" not in hint
    with pytest.raises(NoBatchFitsError, match=r"checkpoint_targets=\['Block'\]"):
        plan(step(Looped()), global_batch=2, memory_limit="150KiB", strategy="binary", steps_per_trial=1, cache=False)
    result = plan(step(Looped()), global_batch=2, memory_limit="150KiB", strategy="binary", steps_per_trial=1,
                  cache=False, checkpoint_targets=["Block"])
    assert (result.micro_batch_sizes, result.checkpointed_modules) == ([1, 1], ["layer"])
    result.undo()
