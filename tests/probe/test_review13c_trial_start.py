"""A mask a forward keeps as a plain attribute is dropped as each trial begins (review 13c): one a
failed larger trial made was held through the trials below it, so the probe answered less than a
fresh process trains (2261 where 2331 trains; binary search 2048)."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch import TrainStep


class GrowingMask(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        if getattr(self, "mask", None) is None or self.mask.shape[0] < x.shape[0]:
            self.mask = torch.ones(x.shape[0], 512)  # 2 KiB a sample, kept: grown, never shrunk
        return self.linear(x) * self.mask[: x.shape[0], :64]


def _step():
    torch.manual_seed(0)
    model = GrowingMask()
    return TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b).pow(2).mean(),
                     lambda n: torch.randn(n, 64))


def _trains_fresh(batch_size: int) -> bool:
    step = _step()
    try:
        with autobatch.simulated_memory("2MiB"):
            for _ in range(3):
                step(batch_size)
    except torch.OutOfMemoryError:
        return False
    return True


@pytest.mark.parametrize("strategy", ["binary", "auto"])
def test_the_probe_answers_what_a_fresh_process_trains(strategy):
    step = _step()
    found = autobatch.find_max_batch(step, memory_limit="2MiB", strategy=strategy, cache=False).batch_size
    assert not hasattr(step.model, "mask")
    assert _trains_fresh(found) and not _trains_fresh(found + 1)
