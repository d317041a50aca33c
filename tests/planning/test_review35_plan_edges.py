"""A global batch that no fitting micro-batch divides (a prime 97), as the plan tells it.

``plan()`` keeps all 97 samples (balanced: 17 micro-batches of 5 and 3 of 4), yet ``summary()`` wrote
``5 x 20 accumulation steps (sizes 5, 5, 5, 5, ... (20 in all))``: the first four sizes hid the smaller ones, and
it read as 100 samples. With ``multiple_of=2`` a prime global batch cannot be split into multiples, and the error
said "a multiple_of that divides 97", which none but 1 does.

Blocks whose first layer writes their input in place (``nn.ReLU(inplace=True)``) train plainly; where batch 1 needs
checkpointing, the recompute reads the changed input and autograd fails, and ``plan()`` raised its text alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import Plan, TrainStep, plan
from autobatch.planning.accumulation import micro_batch_sizes


def test_review35_summary_writes_uneven_micro_batch_sizes_and_their_sum():
    for balanced, runs in ((True, "5 x 17 + 4 x 3 = 97"), (False, "5 x 19 + 2 x 1 = 97")):
        sizes = micro_batch_sizes(97, 5, balanced=balanced)
        result = Plan(global_batch=97, micro_batch=5, accumulation_steps=20, micro_batch_sizes=sizes,
                      checkpointing=False, balanced=balanced)
        assert f"micro-batch     5 x 20 accumulation steps (sizes {runs})" in result.summary()


def test_review35_a_global_batch_no_smaller_multiple_of_divides_says_only_1_does():
    model = nn.Linear(4, 1)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 4))
    with pytest.raises(ValueError, match=r"a multiple_of that divides 97 \(below 2, only 1 does: multiple_of=1 "):
        plan(step, global_batch=97, max_batch=64, multiple_of=2)  # refused before any probe
    with pytest.raises(ValueError, match=r"a multiple_of that divides 100 \(5, 4 or 2\)"):
        plan(step, global_batch=100, max_batch=64, multiple_of=8)


def in_place_first(inplace: bool = True) -> nn.Module:
    """Blocks whose first layer writes their input in place: the plain model trains; checkpointed, the
    recompute in backward reads that input changed, and autograd fails."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.ReLU(inplace=inplace), nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))  # noqa: E731
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(*(block() for _ in range(4))), nn.Linear(8, 1))


def test_review35_blocks_writing_their_input_in_place_name_checkpointing_and_the_fix():
    model = in_place_first()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 64, 8))
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:  # batch 1 needs checkpointing
        plan(step, global_batch=1, memory_limit="80KiB", strategy="binary", steps_per_trial=1, cache=False)
    assert caught.value.__notes__ == [
        "autobatch: this came from plan()'s activation checkpointing of 4 blocks (1.0, 1.1, 1.2, 1.3); their first layer "
        "is in place: 1.0.0, 1.1.0, 1.2.0, 1.3.0. A block that writes its input in place (inplace=True on its first "
        "layer, or x.add_(...) on it) cannot be recomputed in backward: it would read the input changed. Make that op "
        "not in-place (inplace=False), name other blocks in checkpoint_targets, or plan with allow_checkpointing=False"]
    assert not any("forward" in vars(block) for block in model[1])  # unwrapped again
    # what the note names fits: the same model with inplace=False plans 1 x 1 with the 4 blocks checkpointed (measured)
