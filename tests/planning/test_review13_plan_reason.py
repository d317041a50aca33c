"""A plan's reason names the smallest batch its probe tried: ``multiple_of``, not 1.

Planned at ``multiple_of=8`` where batch 8 needs activation checkpointing, the plan said "batch 1
does not fit without activation checkpointing": batch 1 was never tried, and fits.
"""

from __future__ import annotations

import torch
from torch import nn

import autobatch

WIDTH, TOKENS = 16, 128


def step() -> autobatch.TrainStep:
    """About 110 KiB per sample plainly: 1 MiB fits 9 in one step, fewer beside accumulated gradients."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(*(layer for _ in range(3) for layer in (nn.Linear(WIDTH, WIDTH), nn.GELU())))
    model = nn.Sequential(block(), block())
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3), lambda m, x: m(x).pow(2).mean(),
                               make_batch=lambda b: torch.randn(b, TOKENS, WIDTH))


def test_the_reason_names_multiple_of_as_the_smallest_batch_that_did_not_fit():
    planned = autobatch.plan(step(), global_batch=16, memory_limit="1MiB", multiple_of=8, steps_per_trial=1,
                             cache=False, strategy="halving")  # real trials only: fast
    try:
        assert planned.checkpointing and planned.micro_batch_sizes == [8, 8]
        assert planned.reason.startswith("batch 8 (multiple_of=8) does not fit without activation checkpointing")
    finally:
        planned.undo()
