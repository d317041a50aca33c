"""Grow-back is bounded by the global batch, as the docs say, also under a larger ``max_micro_batch``.

``max_micro_batch=64`` with ``global_batch=16`` grew the micro-batch to 32: a "grow try" that
trained the same single piece as 16 (a wasted try in ``result.grow_attempts``), a
``result.micro_batch`` twice the batch, and after an OOM there a halving to 16 that replayed the
very split that had failed.
"""

from __future__ import annotations

import torch

from autobatch import Runner
from runner_workloads import make_data, make_model, mse


def test_grow_back_never_goes_above_the_global_batch():
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=4,
                    max_micro_batch=64, grow_after=1, progress=False, log_every=None)
    result = runner.fit(make_data(128), steps=8)
    assert result.micro_batch == 16
    assert [attempt["to"] for attempt in result.grow_attempts] == [8, 16]
