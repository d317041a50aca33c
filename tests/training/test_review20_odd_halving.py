"""Halving an odd micro-batch (``Runner._halved``): 3677 samples at micro-batch 3677 went to 1838,
which cuts them into three pieces of about 1226, a third of the memory where half was meant; half
rounded up cuts them into two (found by the docs round, following ``train`` with injected OOMs)."""

from __future__ import annotations

import torch
from torch import nn

import autobatch


def test_an_injected_oom_halves_an_odd_batch_into_two_pieces():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                              global_batch=7, micro_batch=7, progress=False)
    autobatch.inject_oom(runner, at=(0, "backward"))
    result = runner.fit([torch.randn(7, 4)], epochs=1)
    assert [(r["micro_batch_before"], r["micro_batch"], r["action"]) for r in result.oom_recoveries] == [(7, 4, "halve")]
    assert runner._piece_sizes(7) == [4, 3]
