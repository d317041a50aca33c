"""The wall a larger size measured: an answer whose own trial flushed must clear it (issue 16).

A trial that runs out of memory although the allocated bytes plus the failed request stayed
under the limit measured the allocator's wall: the pieces its segments held that were too small
to use (``TrialRecord.wall_bytes``). A smaller size whose trial passed while its steps flushed
the cache met the same wall; where its steady allocated peak is above the level at which the
larger size could no longer be served, it passed by the luck of where its pieces fell, and
:func:`below_measured_wall` steps it down.
"""

from __future__ import annotations

import math
from typing import Callable

from ...memory.units import format_bytes
from .line import secant
from ..trial import TrialRunner

__all__ = ["measured_wall", "below_measured_wall", "measured_wall_note", "below_late_failures", "late_failures_note",
           "CLEAN_WINDOW", "LATE_WINDOW", "UNIT_WINDOW"]

#: a size whose full trial never flushed, this close below a flushing answer, is taken instead
CLEAN_WINDOW = 0.01
#: larger sizes within this fraction above the answer (or one unit, where that is more) are its neighbours at the wall
LATE_WINDOW = 0.03
#: where one unit is more than :data:`CLEAN_WINDOW` of the answer (below 100 units), the size one unit below is
#: tried instead when no clean size is known, as long as it is at most this fraction below
UNIT_WINDOW = 0.05


def measured_wall(runner: TrialRunner, batch_size: int, capacity: int | None) -> tuple[int, int] | None:
    """``(failed size, allocated level)`` where ``batch_size``'s latest pass met the allocator's
    wall (a step after its first flushed the cache) below a size that ran out of memory there:
    the nearest larger size whose failure left a wall figure, and the capacity less that figure,
    the allocated level at which it could no longer be served; None where there is none."""
    record = runner.passed_record(batch_size)
    if capacity is None or record is None or not record.flushes:
        return None
    walls = sorted((r.batch_size, r.wall_bytes) for r in runner.records
                   if not r.passed and r.batch_size > batch_size and r.wall_bytes is not None)
    return None if not walls else (walls[0][0], capacity - walls[0][1])


def below_measured_wall(runner: TrialRunner, found: int, multiple_of: int, capacity: int | None,
                        confirm: Callable[[int], int | None]) -> int | None:
    """The answer (in units) once its steady allocated peak clears the wall the nearest larger
    size measured (:func:`measured_wall`), where its own trial met that wall; each step down
    worth the excess at the passing sizes' bytes per unit, confirmed by a full trial
    (``confirm(units)``: the largest size from ``units`` down that passes one; None if none).

    Why: a size whose trial flushed the cache passed because its free pieces fell right that
    time; past the allocated level at which a slightly larger step could not be served, its
    steps train only while they keep falling right. Measured on an H200 (MobileNetV3-Large,
    bf16, AdamW, 8 GiB cap, ``scripts/bench_promise.py``): 362 ran out of memory at its third
    step with 7.70 GiB allocated and 0.30 GiB in pieces; 361 passed four steps, peaking at
    7.78 GiB and flushing in two, and the ``Runner`` at 361 ran out of memory at its fourth
    step in the probing process, a new one and a resumed one alike. Where its own trial never
    flushed, a size is clear of the wall whatever a larger one met (DenseNet-121's 122)."""
    units = found
    while units is not None and units >= 1:
        wall = measured_wall(runner, units * multiple_of, capacity)
        record = runner.passed_record(units * multiple_of)
        if wall is None or record.step_peak_bytes is None or record.step_peak_bytes <= wall[1]:
            return units
        per_unit = _bytes_per_unit(runner, units, multiple_of, record)
        down = max(1, math.ceil((record.step_peak_bytes - wall[1]) / per_unit)) if per_unit else 1
        units = confirm(units - down) if units > down else None
    return None


def _bytes_per_unit(runner: TrialRunner, units: int, multiple_of: int, record) -> float | None:
    """A unit's bytes near ``units``: the secant through the two largest passing steady peaks at
    or below it, else the step's own bytes over its units (intercept included: an overestimate,
    so a step down may fall short and the next check measures again)."""
    points = sorted({r.batch_size // multiple_of: r.step_peak_bytes for r in runner.records
                     if r.passed and r.step_peak_bytes is not None and r.batch_size <= units * multiple_of}.items())
    fit = secant(points)
    if fit is not None:
        return fit.slope
    resident = record.resident_bytes
    return None if resident is None or record.step_peak_bytes <= resident else (record.step_peak_bytes - resident) / units


def measured_wall_note(runner: TrialRunner, passed: int, answer: int, capacity: int | None) -> str:
    """Why the answer is below the largest size that passed (:func:`below_measured_wall`)."""
    wall = measured_wall(runner, passed, capacity)
    failed, level = wall if wall is not None else (passed + 1, 0)
    return (f"{answer}, below {passed}, which passed: {passed}'s steps flushed the allocator's cache and peaked "
            f"above {format_bytes(level)}, where {failed} ran out of memory with the rest held in pieces too small "
            f"to use; such a size trains only while its pieces fall right")


def below_late_failures(runner: TrialRunner, found: int, multiple_of: int,
                        confirm: Callable[[int], int | None] = lambda units: units) -> int | None:
    """The answer (in units): ``found``, or the largest size at most :data:`CLEAN_WINDOW` below it
    whose full trial passed without flushing the cache, where ``found``'s own trial flushed after
    its first step and a larger size within :data:`LATE_WINDOW` failed at the allocator's wall
    only after a step had passed (its steady step left no room beside the split pieces, it ran
    out of memory with room unusable, or it kept flushing). No trial is added but ``confirm(units)``'s
    (:func:`below_measured_wall`'s): only a size already tried is taken, its pass confirmed after
    the last failure as the answer's (None where nothing from it down passes).

    Why: there the wall moves with the allocator's history, and a flushing answer passed by where
    its pieces fell. Measured on an H200 (a CLIP dual encoder, bf16, AdamW, 8 GiB cap,
    ``scripts/bench_promise.py --workloads clip``): 127 to 130 failed at their fourth step, 128
    after six flushing ones; 126 passed five steps flushing in two, and the ``Runner`` at 126 ran
    out of memory at step 4 in the probing process and step 2 in a new one (532 MiB held in pieces),
    where 125, whose three steps never flushed, trained 200 steps in both as a plain loop. Where the
    size above failed at its first step (ResNet-50's ``TrainStep``: 182 over the peak limit), the
    flushing answer stands: 181 trained 200 steps everywhere.

    Where one unit is more than a percent of the answer (below 100 units) and no clean size is known, the
    size one unit below is confirmed instead (a new trial), as long as it is within :data:`UNIT_WINDOW`; the
    neighbours above count from one unit up. Measured on an H200 (a Whisper encoder-decoder, bf16, AdamW,
    8 GiB cap): 26 failed at its first step, 25 at its second at the wall; 24 passed three steps flushing
    in one, and the ``Runner`` at 24 ran out of memory at step 3 in the probing process and in a new one,
    where 23 trained 200 steps as a plain loop."""
    top = found * multiple_of
    record = runner.passed_record(top)
    if record is None or not record.flushes:
        return found
    late = any(not r.passed and top < r.batch_size <= max(top * (1 + LATE_WINDOW), top + multiple_of)
               and (r.steps or 0) >= 2 and (r.over_bytes is not None or r.wall_bytes is not None or r.flushed_out)
               for r in runner.records)
    if not late:
        return found
    clean = [r.batch_size for r in runner.records
             if r.passed and not r.flushes and (r.steps or 0) >= max(2, runner.steps) and r.batch_size % multiple_of == 0
             and top * (1 - CLEAN_WINDOW) <= r.batch_size < top]
    if clean:
        return confirm(max(clean) // multiple_of)
    below = (found - 1) * multiple_of
    if 1 <= below < top * (1 - CLEAN_WINDOW) and below >= top * (1 - UNIT_WINDOW):
        return confirm(found - 1)
    return found


def late_failures_note(passed: int, answer: int, clean: bool = True) -> str:
    """Why the answer is below a flushing size that passed (:func:`below_late_failures`); ``clean``: the
    answer's full trial never flushed (else it is a size confirmed below, one unit down or more)."""
    return (f"{answer}, below {passed}, which passed: {passed}'s steps flushed the allocator's cache, and a size "
            f"just above it failed at the allocator's wall after steps that fit, where the wall moves with the "
            f"allocator's history; " + (f"{answer}'s full trial never flushed" if clean else
                                        f"{answer} passed its full trial below it (no size whose trial never "
                                        f"flushed was known within a percent below {passed})"))
