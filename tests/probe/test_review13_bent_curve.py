"""Review 13: a memory curve that bends (a contrastive loss's batch x batch similarity matrix).

The quick estimate's secant through a small trace and a far one fell short of the boundary of a
quadratic curve (727 where 2173 fits), and ``auto`` then climbed to it in 20 trials."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autobatch import TrainStep, find_max_batch, simulated_memory
from autobatch.probe.tracing.bent_curve import follow_bend


def _counting(curve):
    traced = []

    def peak(units: int) -> int:
        traced.append(units)
        return curve(units)

    return peak, traced


def test_the_secant_method_lands_on_a_quadratic_curves_boundary():
    peak, traced = _counting(lambda b: 1_000_000 + 500 * b + 12 * b * b)
    capacity = 64 * 2**20
    exact = max(b for b in range(1, 5000) if 1_000_000 + 500 * b + 12 * b * b <= capacity)
    units, _, _ = follow_bend(peak, 256, 10_804, capacity, None)
    assert abs(units - exact) <= 0.01 * exact  # the first secant alone: 727 of 2316
    assert len(set(traced)) <= 2 + 6


def test_a_straight_curve_traces_nothing_more():
    peak, traced = _counting(lambda b: 3_000_000 + 4096 * b)
    units, intercept, slope = follow_bend(peak, 256, 15_650, 67_108_864, None)
    assert units == (67_108_864 - 3_000_000) // 4096 and slope == 4096 and intercept == 3_000_000
    assert set(traced) == {256, 15_650}


def test_auto_probes_a_contrastive_loss_in_a_few_trials():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))

    def clip_loss(m, batch):
        a, b = (F.normalize(m(x), dim=-1) for x in batch)
        return F.cross_entropy(a @ b.T / 0.07, torch.arange(len(a)))

    step = TrainStep(model, torch.optim.AdamW(model.parameters()), clip_loss,
                     lambda n: (torch.randn(n, 16), torch.randn(n, 16)))
    with simulated_memory("4MiB"):
        result = find_max_batch(step, strategy="auto", cache=False)
    assert result.smallest_failed == result.batch_size + 1  # exact (553)
    assert len(result.trials) <= 6, [(t.batch_size, t.passed) for t in result.trials]  # was 10
