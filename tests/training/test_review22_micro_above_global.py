"""Review 22: ``Runner(global_batch=8, micro_batch=16)`` was capped to 8 without a word.

A probe's answer above the global batch trains the same capped; swapped arguments (16 samples a
step meant) trained half the batch the user meant. Now one warning names both and what to pass.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from autobatch import Runner


def _runner(caplog, **sizes):
    model = nn.Linear(4, 1)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).mean(), progress=False, **sizes)


def test_a_micro_batch_above_the_global_batch_is_capped_with_one_warning(caplog):
    runner = _runner(caplog, global_batch=8, micro_batch=16)
    assert runner.micro_batch == 8
    warned = [r.getMessage() for r in caplog.records if "micro_batch=16" in r.getMessage()]
    assert len(warned) == 1 and "raise global_batch" in warned[0] and "micro_batch=8" in warned[0]

