"""Search strategies over batch sizes, given an oracle that says whether a size trains.

Every strategy works in *units* of ``multiple_of`` (unit ``k`` is batch ``k * multiple_of``),
never proposes more than ``max_units``, and returns the largest unit that *passed a trial*,
or None when even unit 1 failed. None of them can return an untested size.

* ``halving``   start high, halve until a trial passes (the classic recipe).
* ``power``     double from ``start`` until a trial fails; return the last pass.
* ``binary``    double, then bisect the bracket to the exact boundary (Lightning's binsearch).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["halving", "power", "binary", "bisect", "STRATEGIES"]

Oracle = Callable[..., bool]  # (units, purpose="search") -> passed


def halving(passes: Oracle, start: int, max_units: int) -> int | None:
    """Try ``start`` (capped at ``max_units``), halving after each failure."""
    units = min(start, max_units)
    while units >= 1:
        if passes(units):
            return units
        units //= 2
    return None


def _bracket(passes: Oracle, start: int, max_units: int) -> tuple[int | None, int | None]:
    """Find (largest pass, smallest fail above it) by doubling up or halving down from start.

    The failing bound is None when ``max_units`` itself passed; the passing bound is None
    when unit 1 failed.
    """
    units = min(start, max_units)
    if not passes(units):
        failed = units
        while units > 1:
            units //= 2
            if passes(units):
                return units, failed
            failed = units
        return None, failed
    passed = units
    while passed < max_units:
        candidate = min(2 * passed, max_units)
        if not passes(candidate):
            return passed, candidate
        passed = candidate
    return passed, None


def power(passes: Oracle, start: int, max_units: int) -> int | None:
    """Double from ``start`` until a trial fails (halving first if ``start`` fails)."""
    return _bracket(passes, start, max_units)[0]


def bisect(passes: Oracle, passed: int, failed: int, purpose: str = "bisect") -> int:
    """Narrow ``passed < failed`` (a pass and a fail) to adjacent units; return the pass."""
    while failed - passed > 1:
        middle = (passed + failed) // 2
        if passes(middle, purpose):
            passed = middle
        else:
            failed = middle
    return passed


def binary(passes: Oracle, start: int, max_units: int) -> int | None:
    """Bracket by doubling/halving, then bisect to the exact boundary."""
    passed, failed = _bracket(passes, start, max_units)
    if passed is None or failed is None:
        return passed
    return bisect(passes, passed, failed)


STRATEGIES: dict[str, Callable[[Oracle, int, int], int | None]] = {
    "halving": halving,
    "power": power,
    "binary": binary,
}
