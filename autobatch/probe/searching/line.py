"""The memory line: peak bytes against batch size, fitted through measured trials.

A training step's memory is very nearly a constant (weights, gradients, optimizer state,
workspaces) plus a cost per sample, so a straight line through measured peaks predicts where
a size stops fitting (:mod:`autobatch.probe.searching.predict` searches with it;
:mod:`autobatch.probe.tracing.estimated` builds one from a fake-tensor trace).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["LinearFit", "secant", "from_corner"]


@dataclass
class LinearFit:
    """``peak_bytes ≈ intercept + slope * batch_size`` through measured points."""

    intercept: float
    slope: float
    points: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def through(cls, points: list[tuple[int, int]]) -> "LinearFit | None":
        """Least-squares line through ``(batch, peak)`` points; None if it cannot be fitted."""
        if len(points) < 2 or len({b for b, _ in points}) < 2:
            return None
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / var
        return cls(intercept=mean_p - slope * mean_b, slope=slope, points=list(points))

    @property
    def usable(self) -> bool:
        """A line that grows with the batch; a flat or falling one predicts nothing."""
        return self.slope > 0

    def predict(self, batch_size: float) -> float:
        """The peak the line gives ``batch_size``."""
        return self.intercept + self.slope * batch_size

    def predict_max(self, capacity: int) -> int:
        """The largest batch whose predicted peak fits ``capacity`` (0 if none does)."""
        return max(0, math.floor((capacity - self.intercept) / self.slope))

    def to_dict(self, unit: int = 1) -> dict:
        """JSON form with batch sizes in samples (``unit`` samples per fitted unit)."""
        return {
            "kind": "linear",
            "intercept_bytes": self.intercept,
            "slope_bytes_per_sample": self.slope / unit,
            "points": [[batch * unit, peak] for batch, peak in self.points],
        }


def secant(points: list[tuple[int, int]], *, usable_only: bool = True) -> LinearFit | None:
    """The line through the largest passing point and a passing point well below it.

    Local, so it follows a gently curving memory curve near the boundary, and it leaves out
    the first (warm-up) trial as soon as two later points exist. Where that lower point ends a
    flat stretch (:func:`from_corner`), the next point above it is used instead. None when fewer than two
    points exist or, with ``usable_only``, when the line does not grow with the batch.
    """
    ordered = sorted(points)
    if len(ordered) < 2:
        return None
    top = ordered[-1]
    below = [point for point in ordered[:-1] if point[0] <= 0.9 * top[0]] or ordered[:-1]
    fit = LinearFit.through([below[-1], top])
    between = [point for point in ordered[:-1] if point[0] > below[-1][0]]
    if fit is not None and between and from_corner(ordered, fit):
        past = LinearFit.through([between[0], top])  # past the corner: closer to the curve
        fit = past if past is not None and past.slope > fit.slope else fit  # not a rounding step's flat top
    if fit is None or (usable_only and not fit.usable):
        return None
    return fit


def from_corner(points: list[tuple[int, int]], fit: LinearFit) -> bool:
    """Whether ``fit``'s lower point ends a flat stretch of ``points``: the peak rose less than
    a quarter as fast up to it as from it (at small sizes an optimizer step's temporaries can
    make the peak, whatever the batch). A line from such a corner is too shallow: it overshoots."""
    (low, low_peak), _ = sorted(fit.points)
    earlier = [(units, peak) for units, peak in sorted(points) if units < low]
    if not earlier or fit.slope <= 0:
        return False
    units, peak = earlier[-1]
    return (low_peak - peak) / (low - units) < 0.25 * fit.slope
