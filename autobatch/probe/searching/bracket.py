"""Steps 2 and 3 of the predictive search (:mod:`autobatch.probe.searching.predict`): jump to the memory
line's boundary, then close the bracket around it.

From a fitted line and the largest passing size, :func:`close_bracket` trials the line's
boundary (the size just above it first, where an OOM is the cheapest trial, unless the line
may settle that size), refits through the
largest passing points after every trial, and, once a trial refutes the line, gallops from the
refuted end in strides of 0.5 %, 1 %, 2 % and bisects what is left. An OOM at the allocator's
wall is no refutation: the line aims below the free pieces it measured and jumps again. The
answer is exact: a passing size whose next size failed (or the ceiling), or, with ``settle``,
whose next size the line puts well past the limit (:data:`SETTLE_FRACTION`).

**A bend.** Each refit is :func:`~autobatch.probe.searching.bent_line.bent_line`'s chord where the passes bend
up clearly, else the secant; a pass while bisecting whose bend points into the bracket hands back to
the line (``MAX_BENDS`` times), and the first trial after such a line was installed is no creep.

**The allocator's wall.** A size whose allocated figures left room for the allocation that
failed ran out of memory because the free pieces of the allocator's segments were too
small (``usable_after``): the line then aims that much below the capacity, and its next
trial is a fresh jump (up to ``MAX_GALLOPS`` times), not a refutation. On an H200 (8 GiB
cap) ViT-B/16's line was right about the allocated peak (1.206 GiB + 0.0645 GiB per
sample) but sizes 101-105 failed with 0.15-0.37 GiB free in pieces. Galloping down, a
stride is at least what a lower bound of the failed size's shortfall (``short_of``) is
worth at the line's slope. Once the line aims below a wall, its trials and gallops
(``purpose="wall"``; bisection's stay short) run every step: there a size's first step
proves little, since the free pieces it needs may be split by the step before, and a full
pass is the answer's own confirmation.

**The line settles the last step** (``settle``: ``capacity`` is a limit that fails every
trial whose allocated peak passes it, and a trial costs a new size's kernel choices). Where
the answer would be at least ``SETTLE_MIN_UNITS``, the line through the two largest passes
puts ``lo + 1``'s peak at least ``SETTLE_FRACTION`` of a unit past the limit, at least
``STAIR_BYTES`` past and at least twice as far past as the line followed to ``lo`` missed
``lo``'s peak by (allocated peaks stray from a line by the allocator's block rounding), and
bends by less than ``STRAIGHT`` from that line, ``lo + 1`` is taken as failed without a trial.
For that the jump tries the boundary itself first, as a full trial (``purpose="edge"``), where
its line puts the size above ``EDGE_FRACTION`` of a unit past: ResNet-50 on an H200 went 182
(over the limit) → 181 where above-first went 183 → 182 → 181.
Not below a wall (its aim is an estimate, not a limit) and not once the line was refuted.

**Below a size that kept flushing** (``flushed_out``: its full trial ran at the allocator's
wall, every step returning the cache to the driver, where that fails a size:
:mod:`~autobatch.probe.settling`), every trial is a full one: down from it in strides of a
percent (one unit below 100 units) that double until a size passes, then bisection until the
bracket is a percent wide. A short trial cannot
see flushing, so galloping and bisecting there paid one-step trials that said nothing: on an
H200 (ResNet-50 as a plain callable, 8 GiB cap) 180, 179 and 178 kept flushing, then 175 and
176 passed one step each (0.2 s apiece, a new size's kernel choices) before 177's full trial.
A passing size whose own settle trial flushed before it settled met the wall too: within two
percent of a size that kept flushing, at ``SETTLE_MIN_UNITS`` or more, the size above it is not
tried (``Bracket.at_wall``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .bent_line import BentLine, bent_line
from .line import LinearFit, secant as _secant

__all__ = ["close_bracket", "Bracket", "MAX_GALLOPS", "STRIDE_FRACTION", "SETTLE_FRACTION", "EDGE_FRACTION",
           "SETTLE_MIN_UNITS", "STAIR_BYTES"]

MAX_GALLOPS = 3  # strides of 0.5 %, 1 %, 2 % cover allocator rounding; farther off, bisect
STRIDE_FRACTION = 0.005  # a gallop's first stride, as a fraction of the batch (at least one sample)
# With ``settle``: the size above a pass is not tried where the line through the two largest
# passes puts its peak at least this fraction of a unit's bytes past the limit (a one-unit
# extrapolation of a secant; ResNet-50's 46-unit one from its leap erred by a third of a unit)
SETTLE_FRACTION = 0.25
# ... and the jump tries the line's boundary first, as a full trial, where the line before it
# puts the size above at least this far past the limit (so the refit is likely to settle it)
EDGE_FRACTION = 0.5
SETTLE_MIN_UNITS = 100  # only where an answer one unit short would still be 99 % of the exact one
# ... and at least this far past: the caching allocator rounds a large block up to 2 MiB and hands
# out a whole cached block whose rest is too small to split, so peaks can stand still or leap by
# that much from one size to the next, whatever a unit is worth
STAIR_BYTES = 2 * 2**20
MAX_BENDS = 2  # bisection hands over to a line along the passes' bend at most this often
STRAIGHT = 0.05  # ... and the refit's slope is within 5 % of the line it followed (no bend, no step)


@dataclass
class Bracket:
    """What :func:`close_bracket` found: ``lo`` the largest passing size, ``fit`` the refined
    line, ``capacity`` the allocated peak it aimed at last (below the capacity after a wall),
    ``settled`` the bytes by which the line put ``lo + 1``'s peak past the limit where it was
    not tried (None: the bracket closed by trials); ``at_wall``: ``lo + 1`` was not tried because
    ``lo`` itself met the wall (:func:`_step_below_flushing`)."""

    lo: int
    fit: LinearFit
    capacity: int
    settled: int | None = None
    at_wall: bool = False  # lo + 1 not tried: lo's own settle trial flushed, below a size that kept flushing


def close_bracket(
    passes: Callable[..., bool], record_pass: Callable[[int], None], points: list[tuple[int, int]], fit: LinearFit,
    lo: int, hi: int | None, max_units: int, capacity: int, above: int,
    short_of: Callable[[int], int | None] | None = None, usable_after: Callable[[int], int | None] | None = None,
    settle: bool = False, flushed_out: Callable[[int], bool] | None = None,
    flushed: Callable[[int], bool] | None = None,
) -> Bracket:
    """Steps 2 and 3: jump to the line's boundary, then close the bracket (gallop where the line is
    refuted, bisect where it creeps); the largest pass, refined line and last aim (:class:`Bracket`).
    ``passes``, ``short_of``, ``usable_after`` are :func:`~autobatch.probe.searching.predict.predictive`'s; ``record_pass(units)``
    adds a passing size's peak to ``points`` (the line's measurements); ``lo``/``hi`` the largest pass and smallest
    failure so far (None: none); ``above`` 1 to try the size above the line's boundary first; ``settle`` lets the
    line settle the last step; ``flushed_out``/``flushed(units)``: a failed size's full trial kept flushing (module
    description), a passing size's settle trial flushed after its first step."""
    gallop = 0  # 0: follow the line; -1 / +1: the line was refuted, gallop down / up
    stride = gallops = walls = 0
    span = 0.0  # the gallop's stride in samples before rounding down (doubles)
    creeping = False  # the last trial followed the line and passed
    # the last trial followed a line just lowered to a wall, or one just aimed along a bend: no creeping yet
    jumped = isinstance(fit, BentLine)
    refollowed = False  # a line refitted after galloping down across the boundary was followed
    edged = False  # the jump tried the line's boundary first (once per search)
    bends = 0  # times bisection handed over to a line aimed along the passes' bend (MAX_BENDS)
    # a size the line says fits already ran out of memory (a fit trial): refuted before any
    # jump, so no line points into the bracket; bisect it
    bisecting = hi is not None and fit.predict_max(capacity) >= hi
    while hi is None or hi - lo > 1:
        if hi is not None and flushed_out is not None and flushed_out(hi):  # only full trials below
            return _step_below_flushing(passes, record_pass, fit, lo, hi, capacity, flushed)
        predicted = fit.predict_max(capacity)
        upper = max_units if hi is None else hi - 1
        edge = False
        if bisecting:
            guess = (lo + hi) // 2
        elif gallop < 0:  # down from hi, no farther than the midpoint
            guess = max(hi - stride, (lo + hi) // 2, lo + 1)
        elif gallop > 0:  # up from lo, no farther than the midpoint
            guess = min(lo + stride, upper if hi is None else (lo + hi) // 2 or lo + 1)
            guess = max(guess, lo + 1)
        else:  # the line's answer (just above it first, when ``above_first``); lo + 1 when it says lo is the maximum
            edge = settle and above and not edged and walls == 0 and lo < predicted < upper and _settles(
                fit, predicted, fit.predict(predicted + 1) - capacity, EDGE_FRACTION)
            edged = edged or edge
            guess = min(max(predicted + (0 if edge else above), lo + 1), upper)
        width = None if hi is None or jumped else hi - lo
        confirming = guess == lo + 1  # checking the line's claim that lo is the maximum
        # below a wall, a size whose first step passes may fail its second (ViT-B/16 as a plain
        # callable on an H200: 100 passed one step, then failed the answer's full trial): run all
        purpose = "wall" if walls and not bisecting else "edge" if edge else "verify"
        passed = passes(guess, purpose)
        if passed:
            record_pass(guess)
            lo = guess
            if lo >= max_units:
                break
        else:
            hi = guess
        if bisecting:
            if passed and bends < MAX_BENDS and (bent := bent_line(points, capacity)) and lo <= bent.predict_max(
                    capacity) < hi:  # the passes bend up (a batch × batch matrix): follow the parabola's line
                fit, bisecting, gallop, creeping, jumped, bends = bent, False, 0, False, True, bends + 1
            continue
        wall = None if passed or gallop or walls >= MAX_GALLOPS or usable_after is None else usable_after(guess)
        jumped = wall is not None and wall < capacity and fit.predict_max(wall) < guess
        if jumped:  # the failure is the wall's: aim below it and jump again
            capacity, walls = wall, walls + 1
            continue
        crept, creeping = creeping, passed and gallop == 0
        if gallop == 0:
            followed, fit = fit, _local(points, capacity) or fit
            if passed and settle and walls == 0 and not refollowed and (hi is None or hi > lo + 1) and (
                    settled := _settled_above(fit, followed, lo, capacity)) is not None:
                return Bracket(lo, fit, capacity, settled=settled)
            if not passed and predicted >= guess:  # the line said it fits: refuted from above
                gallop, span = -1, _first_span(guess)
                stride = max(1, int(span), _short_units(short_of, guess, fit))
            elif passed and (predicted < guess or confirming):  # it said lo was the maximum
                gallop, stride = 1, _first_stride(guess)
            elif passed and hi is None and crept and guess < fit.predict_max(capacity) < guess + _first_stride(guess):
                # twice the line's boundary passed and the refit moves it up by less than a stride
                # each time (a plateau just under the capacity, e.g. an allocator block): gallop
                gallop, stride = 1, _first_stride(guess)
            elif width is not None and hi is not None and (hi - lo) * 2 > width:
                bisecting = True  # the line creeps instead of halving the bracket
        elif gallop < 0 and passed and not refollowed and _points_inside(
                refit := _local(points, capacity), capacity, lo, hi):
            # crossed going down, far enough to measure a new point: a line through it that points
            # into the bracket is followed again, once (a curve that bends: the refuted line came
            # from a flat stretch, such as an optimizer step's peak at small sizes)
            fit, gallop, refollowed = refit, 0, True
            creeping, jumped = False, isinstance(refit, BentLine)  # a bend's first jump is no creep
        elif (gallop < 0 and passed) or (gallop > 0 and not passed) or (gallops >= MAX_GALLOPS and hi is not None):
            bisecting = True  # crossed the boundary, or the line is far off: bisect what is left
        else:
            span *= 2  # down: 0.5 %, 1 %, 2 % (_first_span); up, where overshooting is the cheap OOM: ×2
            stride = max(1, int(span), _short_units(short_of, guess, fit)) if gallop < 0 else stride * 2
        gallops += gallop != 0
    return Bracket(lo, fit, capacity)


def _step_below_flushing(passes, record_pass, fit: LinearFit, lo: int, hi: int, capacity: int,
                         flushed: Callable[[int], bool] | None = None) -> Bracket:
    """Below ``hi``, whose full trial kept flushing the allocator's cache: full trials down from
    it in strides of a percent (one unit below 100 units) that double until one passes, then
    bisection, until the bracket is a percent wide, or two percent where ``lo``'s own settle trial
    flushed (``flushed``) at an answer of at least ``SETTLE_MIN_UNITS``: its steps met the wall
    too, so a larger step, which needs more at the same wall, would not stop flushing, and one
    size short costs under 1 %. On an H200 (ResNet-50 as a plain callable, 8 GiB cap) 180 and 179
    kept flushing, 177 stopped at its sixth step after four flushing ones, and 178, tried, kept
    flushing: 0.62 s for what 177's own trial said."""
    stride = close = max(1, hi // 100)
    while hi - lo > close:
        if flushed is not None and lo >= SETTLE_MIN_UNITS and hi - lo <= 2 * close and flushed(lo):
            return Bracket(lo, fit, capacity, at_wall=True)
        guess = max(lo + 1, hi - stride) if stride else (lo + hi) // 2
        if passes(guess, "wall"):
            record_pass(guess)
            lo, stride = guess, 0  # crossed: bisect what is left
        else:
            hi, stride = guess, stride * 2
    return Bracket(lo, fit, capacity)


def _settled_above(fit: LinearFit, followed: LinearFit, lo: int, limit: int) -> int | None:
    """The bytes by which the line ``fit`` refitted through the pass at ``lo`` puts ``lo + 1``
    past ``limit`` where that settles ``lo + 1`` as failed, else None: ``fit`` runs through ``lo``; it puts ``lo + 1`` ``SETTLE_FRACTION`` of a unit past
    ``limit``, at least ``STAIR_BYTES`` past, and at least twice as far past as the line
    ``followed`` to ``lo`` missed ``lo``'s measured peak by; and its slope is within
    ``STRAIGHT`` of that line's.

    The miss measures how far a size's allocated peak strays from a line: the allocator hands
    a tensor a whole cached block where the rest is too small to split off, so peaks climb in
    uneven stairs (a small CNN on an H200: +3.2 and +9.4 MB by turns, 6.3 MB per sample on
    average) and move by a few MB with the allocator's history (its 324 peaked 2.4 MB apart in
    two processes, once either side of the limit). There the followed line missed by 2.0 MB
    and the refit put 324 2.1 MB past the limit: not settled."""
    top = max(fit.points, default=None)
    if top is None or top[0] != lo or followed.slope <= 0:
        return None
    missed = abs(followed.predict(lo) - top[1])
    past = fit.predict(lo + 1) - limit
    straight = abs(fit.slope - followed.slope) <= STRAIGHT * followed.slope
    return int(past) if straight and past >= 2 * missed and _settles(fit, lo, past, SETTLE_FRACTION) else None


def _settles(fit: LinearFit, units: int, past: float, fraction: float) -> bool:
    """Whether ``past``, the bytes by which ``fit`` puts ``units + 1``'s peak past the limit,
    is at least ``fraction`` of a unit's bytes and ``STAIR_BYTES``, for an answer of at least
    ``SETTLE_MIN_UNITS`` (one short costs under 1 %). The jump's edge asks it too, so it never
    runs a full trial first where the refit could not settle the size above."""
    return units >= SETTLE_MIN_UNITS and fit.slope > 0 and past >= max(fraction * fit.slope, STAIR_BYTES)


def _local(points: list[tuple[int, int]], capacity: int) -> LinearFit | None:
    """The line to follow through the passing ``points``: aimed along their bend where they bend
    up clearly (:func:`~autobatch.probe.searching.bent_line.bent_line`), else the secant through the two
    largest (a straight curve's, exactly as without the bend)."""
    return bent_line(points, capacity) or _secant(points)


def _points_inside(fit: LinearFit | None, capacity: int, lo: int, hi: int) -> bool:
    """Whether ``fit`` says the boundary lies in ``[lo, hi)`` with something left to learn."""
    return fit is not None and hi - lo > 2 and lo <= fit.predict_max(capacity) < hi - 1


def _short_units(short_of, units: int, fit: LinearFit) -> int:
    """Units worth the bytes a failed ``units`` needed beyond what fits (0: unknown)."""
    short = short_of(units) if short_of is not None else None
    return math.ceil(short / fit.slope) if short and fit.slope > 0 else 0


def _first_span(near: int) -> float:
    """A gallop's first stride after the line was refuted near ``near``, before rounding down:
    half a percent. A refuted line is usually off by the allocator's rounding and fragmentation,
    a percent or two, so small strides that double find the boundary in a few cheap trials.
    Rounded down, because galloping down each stride that still fails is an OOM trial (a
    fraction of a step), while one that overshoots adds a passing trial and a bisection step;
    so down, under one sample, the fraction itself doubles (at 100 samples strides of 1, 1, 2,
    where doubling the rounded count made 1, 2, 4)."""
    fraction = near * STRIDE_FRACTION
    return fraction if fraction < 1 else float(int(fraction))


def _first_stride(near: int) -> int:
    """:func:`_first_span` in whole samples (at least one)."""
    return max(1, int(_first_span(near)))
