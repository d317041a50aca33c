"""A batch larger than the runner's share, as sequence-first inputs ``(T, B, ...)`` with
``global_batch=B`` give: the runner split them along time, silently wrong for the model; its
warning now says dim 0 is what it splits and counts, and how to make the batches batch-first
(found by the probe round)."""

from __future__ import annotations

import logging

import torch
from torch import nn

import autobatch


def test_a_larger_batch_is_told_dim_0_is_the_batch(caplog):
    model = nn.Linear(4, 1)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                              global_batch=8, progress=False)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit([torch.randn(12, 8, 4), torch.randn(6, 8, 4)], epochs=1)
    told = [r.getMessage() for r in caplog.records if "a batch of" in r.getMessage()]
    assert len(told) == 1 and "not 8" in told[0] and "batch_first=True" in told[0], told
