"""``max_micro_batch`` bounds every micro-batch the run trains, not only grow-back's tries.

``Runner(micro_batch=8, max_micro_batch=2)`` trained at 8 with no word; a planned runner
(``micro_batch=None``) with ``max_micro_batch=3`` trained the plan's 10, above its own ceiling of 3;
and a resume with ``max_micro_batch=4`` trained the checkpoint's 8.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autobatch

DATA = [(torch.randn(10, 5), torch.randn(10, 1)) for _ in range(4)]


def runner(**options) -> autobatch.Runner:
    model = nn.Linear(5, 1)
    return autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=10, progress=False, **options)


def test_a_micro_batch_above_max_micro_batch_is_one_error():
    with pytest.raises(ValueError, match="micro_batch=8 is above max_micro_batch=2.*lower micro_batch to at most 2"):
        runner(micro_batch=8, max_micro_batch=2)


def test_a_planned_micro_batch_is_capped_at_max_micro_batch():
    with autobatch.simulated_memory("64MiB"):
        result = runner(max_micro_batch=3, plan_options={"strategy": "binary"}).fit(DATA)
    assert result.micro_batch == 3 and result.plan["micro_batch_sizes"] == [3, 3, 2, 2]


def test_a_resume_trains_at_most_its_own_max_micro_batch(tmp_path):
    runner(micro_batch=8, checkpoint_dir=tmp_path).fit(DATA, steps=2)
    result = runner(max_micro_batch=4).fit(DATA, resume=tmp_path)
    assert result.micro_batch == 4 and result.steps == 4
