"""Property-based tests of the search (Hypothesis): random memory curves, capacities,
``multiple_of``, ``max_batch`` and ``margin``; a fixed seed and a small budget keep CI fast
and reproducible."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autobatch import NoBatchFitsError, find_max_batch, simulated_memory
from workloads import MemoryCurveStep

KiB = 1024
SETTINGS = settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def curves(draw):
    """A monotone peak-memory curve in bytes: linear, convex, stepped (allocator blocks) or
    noisy within the allocator's 512-byte rounding."""
    kind = draw(st.sampled_from(["linear", "convex", "stepped", "noisy"]))
    fixed = draw(st.integers(16 * KiB, 512 * KiB))
    slope = draw(st.integers(64, 8 * KiB))
    if kind == "linear":
        return kind, lambda b: fixed + slope * b
    if kind == "convex":
        quad = draw(st.floats(0.01, 4.0))
        return kind, lambda b: fixed + slope * b + int(quad * b * b)
    if kind == "stepped":
        block = draw(st.sampled_from([2 * KiB, 64 * KiB, 256 * KiB]))
        return kind, lambda b: block * math.ceil((fixed + slope * b) / block)
    # jitter smaller than a sample's bytes keeps the curve monotone, as real peaks are
    return kind, lambda b: 512 * math.ceil((fixed + slope * b + (b * 7919) % min(slope, 509)) / 512)


def _probe(curve, budget, strategy, **options):
    with simulated_memory(budget):
        return find_max_batch(MemoryCurveStep(curve), strategy=strategy, steps_per_trial=1, **options)


@SETTINGS
@given(
    curve=curves(),
    budget=st.integers(1024 * KiB, 6 * 1024 * KiB),
    multiple_of=st.sampled_from([1, 1, 2, 8]),
    max_batch=st.one_of(st.none(), st.integers(1, 4000)),
    margin=st.sampled_from([0.0, 0.0, 0.05]),
    strategy=st.sampled_from(["auto", "predict", "binary", "power", "halving"]),
)
def test_every_answer_passed_a_trial_and_the_next_size_failed_or_is_the_cap(curve, budget, multiple_of, max_batch, margin, strategy):
    kind, peak = curve
    cap = None if max_batch is None else max_batch // multiple_of * multiple_of
    if cap == 0 or peak(multiple_of) > budget:
        with pytest.raises((NoBatchFitsError, ValueError)):
            _probe(peak, budget, strategy, multiple_of=multiple_of, max_batch=max_batch, margin=margin)
        return
    result = _probe(peak, budget, strategy, multiple_of=multiple_of, max_batch=max_batch, margin=margin)
    size = result.batch_size
    passed = {t.batch_size for t in result.trials if t.passed}
    assert size in passed, f"{kind}: {size} was never tested ({sorted(passed)})"
    assert size % multiple_of == 0 and (cap is None or size <= cap)
    assert peak(size) <= budget
    if strategy in ("auto", "predict", "binary") and margin == 0:
        above = size + multiple_of
        failed = {t.batch_size for t in result.trials if not t.passed}
        assert size == cap or above in failed, f"{kind}: {above} not shown to fail above {size}"
        assert peak(above) > budget or size == cap


@SETTINGS
@given(curve=curves(), budget=st.integers(1024 * KiB, 6 * 1024 * KiB), multiple_of=st.sampled_from([1, 4]))
def test_predict_never_takes_more_trials_than_binary(curve, budget, multiple_of):
    _, peak = curve
    if peak(multiple_of) > budget:
        return
    binary = _probe(peak, budget, "binary", multiple_of=multiple_of)
    for strategy in ("predict", "auto"):
        predicted = _probe(peak, budget, strategy, multiple_of=multiple_of)
        assert predicted.batch_size == binary.batch_size
        assert predicted.num_trials <= binary.num_trials, (strategy, predicted.num_trials, binary.num_trials)
