"""A measured memory curve that bends up: the predictive search's line, aimed along a parabola.

The predictive search (:mod:`autobatch.probe.searching.predict`) follows the line through its two largest
passing trials. A contrastive (CLIP-style) loss builds a batch × batch similarity matrix, so its
peak is ``a + b·n + c·n²``: every line through two passes is flatter than the curve beyond them,
so it overshoots, each jump fails, and failed trials measure no peak to correct it with. The
bracket then closed almost like bisection (a two-tower MLP under a 64 MiB budget: 18 trials to
2327, 11 of them halving 512..4096).

The passes' peaks show the bend. :func:`bent_line` takes three passing sizes spread apart (the
largest; of the others, the middle with a pass at most ``SPREAD`` of it below, chosen so that its
sag weighs most; never the smallest pass, the first trial, whose peak carries one-off costs). Where
the slope between the upper two exceeds the lower two's by more than ``BEND`` and the middle point
lies at least ``BEND_BYTES`` below the chord of the outer two (allocator rounding moves a real peak
by up to a 2 MiB block, so a straight curve's points never sag that far), and the pass below the
three rose at least ``CORNER`` of what the parabola through them says (else the three sit on a
corner: an optimizer step's flat peak at small sizes, then a straight line), the parabola meets the
capacity at some size ``r``, and the line returned is the parabola's chord from the largest pass to
``r``: its boundary is ``r``, its slope the curve's near ``r``. The search follows it like any line,
so its guarantees hold (every answer passed a trial; the size above failed or was settled). A curve
whose slope falls (concave), rises within ``BEND``, sags less than ``BEND_BYTES`` or turns a corner
gets None: the straight line, exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .line import LinearFit

__all__ = ["bent_line", "BentLine", "BEND", "BEND_BYTES", "SPREAD", "CORNER"]

#: the slope between the upper two points exceeds the lower two's by more than this fraction (the
#: sag below, in bytes, is what tells a bend from allocator rounding)
BEND = 0.1
#: ... and the middle point lies at least this far below the outer two's chord (two allocator blocks)
BEND_BYTES = 4 * 2**20
#: the three points lie at most this fraction of the next one above (spread, so noise bends little)
SPREAD = 0.9
#: ... and the point below them rose at least this fraction of what the parabola says (else: a corner)
CORNER = 0.5


@dataclass
class BentLine(LinearFit):
    """A chord of the parabola through ``points`` (low, middle, largest pass), from the largest
    pass to the parabola's boundary; ``curvature`` its bytes per unit²."""

    curvature: float = 0.0

    def to_dict(self, unit: int = 1) -> dict:
        """:meth:`LinearFit.to_dict`, and the parabola's curvature per sample²."""
        return {**super().to_dict(unit), "bend_bytes_per_sample2": self.curvature / unit**2}


def bent_line(points: list[tuple[int, int]], capacity: int) -> BentLine | None:
    """The chord, from the largest pass to where it meets ``capacity``, of the parabola through
    three spread passing ``(units, peak)`` points, where they bend up clearly (module
    description); None where they do not, or the parabola never reaches ``capacity`` above its
    lowest point (then the straight line is all there is)."""
    every = sorted(dict(sorted(points)).items())  # one peak per size
    three = _spread_three(every[1:])  # never the first trial's peak: it carries one-off costs
    if three is None:
        return None
    low, mid, top = three
    lower, upper = _slope(low, mid), _slope(mid, top)
    if lower <= 0 or upper <= lower * (1 + BEND):
        return None
    curvature = (upper - lower) / (top[0] - low[0])
    if curvature * (mid[0] - low[0]) * (top[0] - mid[0]) < BEND_BYTES:  # the middle's sag below the chord
        return None
    # a corner, not a bend: up to the point below, the parabola falls, or the peaks rose much less
    # than it says (a flat stretch: an optimizer step's peak at small sizes, then a straight line)
    below = [point for point in every if point[0] < low[0]][-1:]
    said = lower - curvature * (mid[0] - below[0][0]) if below else 0
    if said <= 0 or _slope(below[0], low) < CORNER * said:
        return None
    # the parabola about the largest pass: peak(top + x) = top_peak + rising * x + curvature * x²
    rising = upper + curvature * (top[0] - mid[0])
    room = capacity - top[1]
    discriminant = rising * rising + 4 * curvature * room
    if discriminant < 0 or rising + math.sqrt(discriminant) <= 0:
        return None
    x = 2 * room / (rising + math.sqrt(discriminant))  # the root above the vertex, stable for either sign
    slope = rising + curvature * x
    if slope <= 0:
        return None
    return BentLine(intercept=top[1] - slope * top[0], slope=slope, points=[low, mid, top], curvature=curvature)


def _spread_three(ordered: list[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """``(low, mid, top)``: the largest point, and the middle point (with the largest point at
    most ``SPREAD`` of it as ``low``) whose sag below the outer chord weighs the most; None
    where no three points are that far apart."""
    top, best, weight = ordered[-1] if ordered else None, None, 0
    for mid in ordered[:-1]:
        low = _below(ordered, mid[0])
        if low is not None and (mid[0] - low[0]) * (top[0] - mid[0]) > weight:
            best, weight = (low, mid, top), (mid[0] - low[0]) * (top[0] - mid[0])
    return best


def _below(ordered: list[tuple[int, int]], units: int) -> tuple[int, int] | None:
    """The largest point at most ``SPREAD`` of ``units``."""
    below = [point for point in ordered if point[0] <= SPREAD * units]
    return below[-1] if below else None


def _slope(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Bytes per unit from point ``a`` to point ``b``."""
    return (b[1] - a[1]) / (b[0] - a[0])
