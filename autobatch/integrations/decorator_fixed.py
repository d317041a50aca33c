"""Failures of :func:`~autobatch.integrations.decorator.find_executable_batch_size` at a point whose
memory barely depends on the batch size: the model, its gradients and optimizer state alone
do not fit (:func:`fixed_point`, :func:`fixed_step`, :func:`fixed_hint`).

Why: where they do not (an AdamW MLP of 1.3 MB under a 1 MiB cap, built inside the function),
every attempt ran out of memory at the optimizer's first step, on the same 256 KiB allocation (a
moment of one weight), with the memory in use there shrinking by 528 bytes a sample (the batch's
inputs); the ×0.9 walk went on from 144 to batch 1 (43 attempts, 27 s on the CPU), then advised
gradient accumulation, which cannot help.

The rule, measured on a call's last three failed attempts: the same failed request R, the same
message but for its figures, and the bytes each had grown by at the failure (above its start)
on one line of the size with a positive slope d (memory that does shrink with the batch), whose
value at batch 1 plus R is over the device's capacity. That line fits two functions alike: one
whose fixed part (the line at batch 0, F) does not fit, where no size passes that point, and one
that fills the memory a sample at a time in R-sized pieces (a tensor per sample, F being the
pieces that fit), where about (usable - start) / (R + d) samples run. The next size is that one
(a jump, not a walk), and a jump that failed the same way halves after: the first function
reaches batch 1 in a few attempts (3, then 1, above), and the second runs at the size its pieces
allow (a jump that fell short of it is not followed by smaller ones). A slope of zero (the same
bytes in use at every size) is left to the check for a function that ignores its batch size
(:func:`~autobatch.integrations.decorator_stop.fixed_failure`): no sample's share was seen.
The bytes at a failure are read from the allocator's message where it says more than the handler
sees, and the message rounds them ("1.14 MiB already in use": to 0.01 MiB; CUDA's GiB, to 10 MiB):
a failure may lie off the line by that step too. Without it, an AdamW MLP prepared by an
``accelerate.Accelerator`` outside the function, whose state did not fit a 1.17 MiB cap, walked
×0.9 from 188 to batch 1 (27 attempts, where exact figures take 9): its failures' figures,
rounded, made steps, not a line.
At batch 1, failures on such a line raise ``NoBatchFitsError`` saying that the fixed part does
not fit (:func:`fixed_hint`), not to accumulate gradients.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..memory.oom import allocated_resolution
from ..memory.units import format_bytes
from ..probe.arguments import ALLOCATOR_HEADROOM

if TYPE_CHECKING:
    from .decorator import Attempt

__all__ = ["FIXED", "FixedPoint", "fixed_point", "fixed_step", "fixed_hint"]

#: ``Attempt.next_from`` of a jump past failures at a fixed point
FIXED = "fixed_point"
#: how far the middle failure may lie off the line through the other two: a share of the bytes
#: the line spans, plus an allocator's rounding (CUDA rounds each block up to 512 bytes)
_OFF_LINE, _ROUNDING = 0.1, 1024


@dataclass(frozen=True)
class FixedPoint:
    """Where the failures met: the request that failed, the bytes a sample adds there, the bytes
    there apart from the batch (above the last attempt's start), that start and the capacity."""

    request: int
    per_sample: float
    fixed: int
    start: int
    capacity: int
    sizes: tuple[int, ...]

    @property
    def needed(self) -> int:
        """The bytes batch 1 needs at that point, by the line: over the capacity."""
        return int(self.start + self.fixed + self.per_sample + self.request)


def fixed_point(attempts: list["Attempt"]) -> FixedPoint | None:
    """The point the last three failed ``attempts`` (a call's) met, where the rule in the module
    description holds; None where it does not (or an attempt lacks a figure: no instruments)."""
    failed = [attempt for attempt in attempts if not attempt.ok][-3:]
    if len(failed) < 3 or any(attempt.failed_at_bytes is None or attempt.start_bytes is None
                              or not attempt.capacity_bytes or not attempt.requested_bytes for attempt in failed):
        return None
    if len({attempt.requested_bytes for attempt in failed}) > 1 or len({_shape(attempt.error) for attempt in failed}) > 1:
        return None
    sizes = [attempt.batch_size for attempt in failed]
    if not sizes[0] > sizes[1] > sizes[2]:
        return None
    grown = [attempt.failed_at_bytes - attempt.start_bytes for attempt in failed]  # type: ignore[operator]
    per_sample = (grown[0] - grown[2]) / (sizes[0] - sizes[2])
    if per_sample <= 0:
        return None  # the same bytes at every size: no sample's share seen
    off = abs(grown[2] + per_sample * (sizes[1] - sizes[2]) - grown[1])
    rounded = max(allocated_resolution(attempt.error) for attempt in failed)  # the message's figures' step
    if off > _OFF_LINE * (grown[0] - grown[2]) + _ROUNDING + rounded:
        return None
    last = failed[-1]
    point = FixedPoint(request=int(last.requested_bytes), per_sample=per_sample,  # type: ignore[arg-type]
                       fixed=int(grown[2] - per_sample * sizes[2]), start=int(last.start_bytes),  # type: ignore[arg-type]
                       capacity=int(last.capacity_bytes), sizes=tuple(sizes))  # type: ignore[arg-type]
    return point if point.needed > point.capacity else None


def fixed_step(attempts: list["Attempt"], point: FixedPoint) -> int:
    """The next size after ``attempts[-1]`` failed at ``point``: the samples that fit at one
    R-sized piece each, or half the size where a jump already failed this call (before the
    caller caps it below the failed size)."""
    if any(attempt.next_from == FIXED for attempt in attempts[:-1]):
        return attempts[-1].batch_size // 2
    usable = point.capacity * (1 - ALLOCATOR_HEADROOM) - point.start
    return max(1, int(usable // (point.request + point.per_sample)))


def fixed_hint(name: str, point: FixedPoint) -> str:
    """``NoBatchFitsError``'s advice where batch 1 failed at ``point``: what does not fit, and what helps."""
    sizes, last = ", ".join(str(size) for size in point.sizes), point.sizes[-1]
    return (
        f"find_executable_batch_size stopped at batch {last}: the attempts of `{name}` at batch {sizes} ran out "
        f"of memory at one point, allocating {format_bytes(point.request)}, with the memory in "
        f"use there shrinking by only {format_bytes(point.per_sample)} a sample: even at batch 1 that point needs "
        f"about {format_bytes(point.needed)} ({format_bytes(point.start + point.fixed)} of it not depending on the "
        f"batch) of the device's {format_bytes(point.capacity)}. What does not fit is fixed in size: the model, its "
        "gradients and optimizer state (or another fixed-size buffer), so gradient accumulation and a smaller batch "
        "cannot help. Use a smaller model, lower-precision weights or optimizer state (bf16, an 8-bit optimizer), "
        "sharding (FSDP: autobatch.distributed), CPU offload of the optimizer state, or a larger device."
    )


def _shape(error: str | None) -> str:
    """An allocator message with its figures blanked: the same point at another size reads the same."""
    return re.sub(r"[0-9][0-9.,]*", "#", error or "")
