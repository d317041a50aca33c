"""Blocks whose forward another library replaced on the instance (Accelerate's ``add_hook_to_module``,
used by ``device_map`` and offloading, sets ``module.forward``) are never wrapped. Where every block was
such a one, the plan's error said "found no repeated blocks to wrap: name the block classes in
checkpoint_targets, e.g. ['Block']", and naming them wrapped nothing either.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.checkpointing import no_blocks_hint
from workloads import Block


def hooked(module: nn.Module) -> nn.Module:
    """``module`` with its forward replaced on the instance, as Accelerate's hooks do."""
    old = module.forward
    module.forward = functools.update_wrapper(functools.partial(lambda m, *a, **k: old(*a, **k), module), old)
    return module


def _held(*blocks: nn.Module) -> nn.Module:
    model = nn.Module()
    for index, block in enumerate(blocks):
        model.add_module(f"b{index}", block)
    return model


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("targets", [None, ["Block"]])
def test_blocks_with_a_replaced_forward_are_named_and_the_way_to_checkpoint_them(targets):
    model = nn.Sequential(*(hooked(Block()) for _ in range(4)), nn.Linear(8, 1))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 128, 8))
    with pytest.raises(NoBatchFitsError, match=r"blocks found \(\['0', '1', '2', '3'\]\) have a forward another library "
                                               r"replaced on the instance.*allow_checkpointing=False"):
        plan(step, global_batch=2, memory_limit="150KiB", strategy="binary", steps_per_trial=1, cache=False,
             checkpoint_targets=targets)
    # the same blocks unhooked: the hint names their class, as before
    assert "checkpoint_targets=['Block']" in no_blocks_hint(_held(Block(), Block()))
