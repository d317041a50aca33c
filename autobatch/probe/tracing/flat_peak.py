"""A step whose estimated peak is flat at small batches: where the optimizer step's temporaries
and state (AdamW on a small model: constant in the batch) outweigh the forward and backward
pass's activations, the peak is the optimizer step's until the batch is large enough, so two
small traces say nothing of the slope. :func:`past_flat` traces larger sizes, as
:func:`~autobatch.probe.tracing.estimate.estimate_max_batch` brackets the capacity (by ``GROWTH``), until
the peak grows; the line through the last flat size and the first that grew then reaches the
rising part of the curve (the boundary is where the larger of the two phases' peaks reaches the
capacity), and the quick estimate's secant trace closes on it."""

from __future__ import annotations

from typing import Callable

from ..arguments import SEARCH_CEILING

__all__ = ["past_flat"]


def past_flat(
    peak: Callable[[int], int], low: int, high: int, capacity_bytes: int, *, growth: int, max_units: int | None,
    multiple_of: int, flat_units: int,
) -> tuple[int, int]:
    """``(low, high)`` in units with ``peak(high) > peak(low)``: ``high`` multiplied by ``growth``
    (at most ``max_units``) while its peak equals ``low``'s, ``low`` following to the last flat
    size. Stops flat (the caller then refuses the estimate, as before) where the peak already
    exceeds ``capacity_bytes`` (no batch fits: trials say so), where ``max_units`` or the search
    ceiling is reached, or past ``flat_units`` (where ``estimate_max_batch`` too gives up on a peak
    that does not grow), so a step whose memory never grows costs a few traces more, not many."""
    while peak(high) <= peak(low) and peak(high) <= capacity_bytes:
        if (max_units is not None and high >= max_units) or high * multiple_of >= SEARCH_CEILING or high >= flat_units:
            break
        low, high = high, high * growth if max_units is None else min(high * growth, max_units)
    return low, high
