"""Review 14: the predictive search (a GPU's default: no estimate) on memory curves that bend.

A contrastive loss's batch x batch logits make peak memory ``a + b*n + c*n^2``. Every line
through two passes overshoots that curve, so each jump failed and the bracket closed almost like
bisection (16-26 trials here). The passes' peaks show the bend, and the search aims along the
parabola through three of them (:mod:`autobatch.probe.searching.bent_line`); a curve that does not bend
clearly keeps exactly the trials it had.
"""

import math

import pytest

import autobatch.probe.searching.bracket as bracket
import autobatch.probe.searching.predict as predict
from autobatch import find_max_batch, parse_bytes, simulated_memory
from autobatch.probe.searching.bent_line import BEND, BEND_BYTES, bent_line

from workloads import MemoryCurveStep

MiB = 2**20
CLIP = lambda b: 400_000 + 7800 * b + 12 * b * b  # noqa: E731 - a two-tower MLP's measured curve, rounded
ATTENTION = lambda b: 2 * MiB + 900 * b + 0.05 * b * b  # noqa: E731


def _probe(curve, budget: str, **kwargs):
    with simulated_memory(budget):
        return find_max_batch(MemoryCurveStep(curve), strategy="auto", cache=False, **kwargs)


def _exact(curve, budget: int, multiple_of: int = 1, cap: int | None = None) -> int:
    """The largest multiple of ``multiple_of`` (at most ``cap``) whose peak fits ``budget``."""
    c = (curve(2) - 2 * curve(1) + curve(0)) / 2  # the parabola's coefficients, read off three sizes
    a, b = curve(0), curve(1) - curve(0) - c
    n = math.floor((-b + math.sqrt(b * b + 4 * c * (budget - a))) / (2 * c))
    while curve(n + 1) <= budget:
        n += 1
    while curve(n) > budget:
        n -= 1
    n = n // multiple_of * multiple_of
    return n if cap is None else min(n, cap)


@pytest.mark.parametrize("curve, budget, multiple_of, most", [
    (CLIP, "512MiB", 1, 7),  # 16 trials without the bend
    (CLIP, "512MiB", 8, 7),  # 14
    (ATTENTION, "4GiB", 1, 10),  # 26
    (ATTENTION, "512MiB", 8, 8),  # 20
    (lambda b: 400_000 + 7800 * b + 0.05 * b * b, "512MiB", 1, 13),  # 20: bends a little
])
def test_a_curve_that_bends_up_is_followed_along_its_bend(curve, budget, multiple_of, most):
    result = _probe(curve, budget, multiple_of=multiple_of)
    exact = _exact(curve, parse_bytes(budget), multiple_of)
    assert result.batch_size == exact and result.smallest_failed == exact + multiple_of
    assert result.strategy_used == "predict" and result.fallback_reason is None
    assert result.num_trials <= most, [(t.batch_size, t.passed) for t in result.trials]
    assert all(t.passed for t in result.trials if t.batch_size == exact)  # the answer passed a trial
    assert result.fit.get("refined", result.fit)["bend_bytes_per_sample2"] == pytest.approx(
        (curve(2) - 2 * curve(1) + curve(0)) / 2, rel=1e-6)  # the parabola's, per sample²


@pytest.mark.parametrize("cap", [3000, 6369, 6370])
def test_max_batch_caps_a_bent_search(cap):
    result = _probe(CLIP, "512MiB", max_batch=cap)
    assert result.batch_size == _exact(CLIP, 512 * MiB, cap=cap)
    assert max(t.batch_size for t in result.trials) <= cap


CURVES = {  # none bends clearly: their trials are those of the search without the bend
    "linear": (lambda b: 3 * MiB + 2000 * b, "64MiB"),
    "rounded-blocks": (lambda b: 2 * MiB * math.ceil((MiB + 3000 * b) / (2 * MiB)), "512MiB"),
    "workspace-step": (lambda b: 4 * MiB + 2500 * b + (3 * MiB if b > 700 else 0), "64MiB"),
    "optimizer-corner": (lambda b: max(20 * MiB, 4 * MiB + 9000 * b), "512MiB"),  # flat, then straight
    "concave": (lambda b: 5 * MiB + 40_000 * math.sqrt(b) + 1500 * b, "512MiB"),
    "slight-bend": (lambda b: 400_000 + 7800 * b + 0.05 * b * b, "64MiB"),  # sags less than BEND_BYTES
    "small-budget-bend": (CLIP, "16MiB"),
}


@pytest.mark.parametrize("name", sorted(CURVES))
def test_a_curve_that_does_not_bend_clearly_keeps_its_trials(name, monkeypatch):
    curve, budget = CURVES[name]
    with_bend = _probe(curve, budget)
    monkeypatch.setattr(bracket, "bent_line", lambda *args: None)
    monkeypatch.setattr(predict, "bent_line", lambda *args: None)
    without = _probe(curve, budget)
    assert [(t.batch_size, t.passed) for t in with_bend.trials] == [(t.batch_size, t.passed) for t in without.trials]


def test_the_bend_needs_a_sag_beyond_allocator_rounding_and_no_corner():
    capacity = 8 * 2**30
    # a straight curve (20 MB a sample) whose peaks each round up by up to a 2 MiB block: no bend,
    # though next to a size one below it a block's rounding raises the slope by more than BEND
    line = lambda n: 1_500_000_000 + 20_000_000 * n  # noqa: E731
    stairs = [(8, line(8)), (300, line(300)), (340, line(340)), (341, line(341) + 2 * MiB)]
    assert (stairs[3][1] - stairs[2][1]) > (1 + BEND) * 20_000_000
    assert bent_line(stairs, capacity) is None
    # an optimizer step's flat peak, then straight: a corner, not a bend
    corner = [(8, 20 * MiB), (184, 20 * MiB), (4239, 4 * MiB + 9000 * 4239), (48369, 4 * MiB + 9000 * 48369)]
    assert bent_line(corner, 512 * MiB) is None
    concave = [(n, int(5 * MiB + 40_000 * math.sqrt(n))) for n in (8, 64, 512, 4096)]
    assert bent_line(concave, 512 * MiB) is None
    # a parabola: the line's boundary is where it meets the capacity, from the largest pass
    parabola = [(n, CLIP(n)) for n in (8, 64, 512, 2304)]
    line = bent_line(parabola, 64 * MiB)
    assert line.predict_max(64 * MiB) == _exact(CLIP, 64 * MiB)
    assert line.predict(2304) == pytest.approx(CLIP(2304))
    assert 12 * (512 - 64) * (2304 - 512) > BEND_BYTES  # the middle's sag that made it a bend
