"""An estimated memory curve that bends: the secant method on traced peaks.

The quick estimate (:func:`~autobatch.probe.tracing.estimate.estimate_line`) solves the line through
two small traces for the capacity, traces that answer, and takes the secant through it and the
larger small trace. On a straight curve that secant lands on the boundary. A curve that bends
does not: a contrastive loss's batch × batch similarity matrix grows with the square of the
batch, and the secant through a small trace and a far one is steeper than the curve where it
meets the capacity, so it falls short (a small encoder with a 128-wide embedding under a 64 MiB
budget: 727 where 2173 fits, after which the trials climbed in 19 steps). :func:`follow_bend`
goes on by the secant method, each new answer traced and paired with the trace before it, until
an answer lies within ``CLOSE`` of the last trace; on a straight curve it traces nothing more.
"""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["follow_bend", "CURVE_TRACES", "CLOSE"]

#: At most this many more traces while the secant's answer moves
CURVE_TRACES = 6
#: ... and it stops once the answer is within this fraction of the last traced size
CLOSE = 0.01


def follow_bend(peak: Callable[[int], int], near: int, far: int, capacity: int, max_units: int | None, *,
                steps: int = CURVE_TRACES) -> tuple[int, float, float] | None:
    """``(units, intercept, slope)``: the capacity solved on the secant through the traces at
    ``near`` and ``far`` (units), then, while the answer lies more than ``CLOSE`` from ``far``,
    on the secant through the newest trace (the answer's) and the one before it, up to ``steps``
    times (0: the first secant alone). None where the first secant does not rise (the caller's
    error); a later one that does not (a stair of the allocator's rounding) stops at the answer
    before."""
    solved = _solve(peak, near, far, capacity, max_units)
    if solved is None:
        return None
    for _ in range(steps):
        units = solved[0]
        if units < 1 or abs(units - far) <= max(1, CLOSE * far):
            break
        near, far = far, units
        nearer = _solve(peak, *sorted((near, far)), capacity, max_units)
        if nearer is None:
            break
        solved = nearer
    return solved


def _solve(peak: Callable[[int], int], a: int, b: int, capacity: int,
           max_units: int | None) -> tuple[int, float, float] | None:
    """The largest units under ``capacity`` on the line through the peaks at ``a`` and ``b``,
    with that line's intercept and slope; None where it does not rise."""
    slope = (peak(b) - peak(a)) / (b - a)
    if slope <= 0:
        return None
    intercept = peak(a) - slope * a
    units = max(0, math.floor((capacity - intercept) / slope))
    return (units if max_units is None else min(units, max_units)), intercept, slope
