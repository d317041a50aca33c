"""Predictive search: fit peak memory against batch size, jump to the boundary, verify.

Memory of a training step is very nearly linear in the batch size: a constant (weights,
gradients, optimizer state, workspaces) plus activations per sample. So:

1. **Fit.** Run trials at geometrically growing sizes (``start``, ×8, ×64, ...) until the
   straight line through the two largest measured peaks predicts a boundary below the next
   growth step, so the extrapolation is short (small batches are dominated by allocator
   rounding and fixed costs; a long extrapolation from them overshoots). The first trial pays one-off
   costs (cuDNN autotuning workspaces, lazily created optimizer state, CUDA context), so it is
   left out of the fit once two later points exist.

   **Leap.** Where the memory resident before a passing trial's last step is known
   (``resident_of``), the next fit trial is not the ladder's ×8 but ``LEAP_FRACTION`` of the
   size that this one measurement already guarantees (:func:`leap_size`; at least one more
   than the trial): everything the step added above the resident memory (activations,
   gradients, workspaces) counted as if it grew with the batch. That overstates the growth,
   so on a straight memory curve the size fits, and the line through the two points
   extrapolates little. It is further than ×8 where the boundary is far, and short of an
   ×8 that would overshoot where it is near (GPT-2 from 8: 9, not 64). On ResNet-50 (H200,
   16 GiB cap) it lands at 270 of 369 from 8, where the ladder needed 1, 8 and 64. A leap
   that runs out of memory (a curve that bends up) leaves the ladder to go on below it.
   What the largest pass guarantees also checks the line: a straight curve's boundary lies
   between the two, so a line that puts it more than ``SHALLOW`` past the guarantee rose from
   a lower point on a flat stretch (at small sizes an optimizer step's temporaries can make
   the peak), and the fit grows by one more leap before it jumps (ViT-B/32 under AdamW on an
   H200: the line through 8 and 74 said 513, 74 guaranteed about 343, the maximum was 382).
2. **Jump** (steps 2 and 3 live in :mod:`autobatch.probe.searching.bracket`). Trial the predicted
   boundary; with ``above_first``, the size just above it first, then the boundary itself.
   Why: when the answer must pass a *full* trial after the last OOM and search trials are
   shorter (:func:`~autobatch.find_max_batch`), an OOM is the cheapest trial (it stops
   part-way through a step). Above-then-at then costs one cheap OOM and one full pass when
   the line is right, where at-then-above costs a search pass, an OOM and a second, full
   pass of the answer. A pass above the boundary refutes
   the line (it said that size fails). When every trial is full, at-then-above needs the
   same two trials and wins when the line is high, so it stays the order.
3. **Close the gap.** Refit through the two largest passing points (a secant, so curvature
   from allocator rounding or workspaces is followed locally), predict again inside the
   bracket (largest pass, smallest OOM), trial, and repeat until the bracket's ends are
   adjacent. Failed trials are used only as upper bounds (an OOM stops before the peak).
   Once a trial refutes the line (an OOM where it said the batch fits, as when the
   allocator's rounding makes the usable capacity a little smaller; or a pass where it said
   the previous size was the maximum, as on a plateau), the search gallops from the refuted
   end in strides that start at 0.5 % and double, never past the bracket's midpoint, until a
   trial lands on the other side (or three strides did not, when the line is far off); then
   it bisects what is left, unless the line through the new passing point points into the
   bracket: that line is followed again, once (a line fitted on a flat stretch, such as an
   optimizer step's peak at small sizes, overshoots far). A line that creeps instead of
   halving the bracket is also abandoned for bisection. An OOM at the allocator's wall (the
   allocated figures left room; the free pieces of its segments were too small) is no
   refutation: the line aims that far below the capacity and jumps again, and from then on
   the trials it and its gallops make run every step (a size's first step proves little at
   the wall; bisection's trials stay short). So the worst case
   stays close to binary search, and the answer is exact like binary's: a passing size whose
   next size failed (or ``max_batch``).

**A curve that bends up** (a contrastive loss's batch × batch logits: ``a + b·n + c·n²``) makes
every line through two passes overshoot, and failed trials measure no peak to correct it. Where
three spread passes (not the first trial) bend up clearly, by more than allocator rounding, the
jump and every refit aim along the parabola through them instead
(:func:`~autobatch.probe.searching.bent_line.bent_line`), and a bisection that finds such a bend hands back to
it (two-tower MLP under 64 MiB: 9 trials where it took 18). A curve that does not (straight,
stepped by the allocator, a flat optimizer-step corner, concave) keeps the secant, trial for trial.

With an estimated curve (``prior``, from a fake-tensor trace of the step), step 1 is replaced
by one trial ``PRIOR_BELOW`` under the estimated boundary (20 % lower if that ran out of
memory); the estimate's slope through that measured point makes the first jump.

While the measurements give no usable line (flat peaks: small batches that fit in one
allocator block, an optimizer step whose temporaries make the peak at small sizes, or a step
whose memory does not depend on the batch) the fit keeps growing by ×8; a line that starts
where a flat stretch ends is too shallow, so the fit grows by a leap once more before it
jumps. If the first OOM arrives before a growing line exists (flat peaks, a single passing
point, or a ``start`` above the boundary, halved, and at 8 units or fewer stepped down by a quarter, until a size passes), the bracket is bisected
until a passing size gives one, and the line is followed from there. Where none appears before
the bracket closes, the search is binary bisection, continuing from the trials already made
(none is repeated), and the result says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from . import strategies as search
from .bent_line import bent_line
from .bracket import close_bracket
from .line import LinearFit, from_corner as _from_corner, secant as _secant

__all__ = ["predictive", "leap_size", "LinearFit", "GROWTH", "JUMP_RATIO", "LEAP_FRACTION"]

GROWTH = 8  # size ratio between successive fit trials
JUMP_RATIO = 8  # extrapolate at most this far beyond the largest measured size (one growth step)
STEP_DOWN = 0.75  # at SMALL_UNITS or fewer, a first trial that ran out of memory steps down to this fraction of it
SMALL_UNITS = 8  # ... and above it, halves (_step_down_to_pass); 8, the default first trial
PRIOR_BELOW = 0.03  # with an estimated curve, the first trial is this fraction below its boundary
LEAP_FRACTION = 0.9  # the leap lands this far below the size the first trial guarantees
# a line that puts the boundary this much past what its largest pass guarantees started on a
# flat stretch: grow by one more leap before jumping (:func:`_past_guarantee`). Where the line
# is right the two differ by the step's fixed growth (gradients) at the pass's size: 1-2 % on
# ResNet-50 and ViT-B/16 as plain callables; the small transformer of the tests, 9-12 %, was a
# corner's line that overshot by as much
SHALLOW = 0.05


@dataclass
class PredictOutcome:
    """The largest passing unit, the fitted line (and its refinement near the boundary)."""

    units: int | None
    fit: LinearFit | None
    fallback_reason: str | None
    strategy_used: str
    points: list[tuple[int, int]] = field(default_factory=list)
    refined: LinearFit | None = None
    aimed: int | None = None  # the allocated peak the line aimed at, where a wall lowered it
    settled: int | None = None  # bytes the line put the size above the answer past the limit, untried
    at_wall: bool = False  # the size above the answer untried: the answer's own settle trial met the wall

    def fit_record(self, unit: int) -> dict | None:
        """The fit as stored in ``ProbeResult.fit`` (batch sizes in samples): the line the
        jump used, every measured passing point, and the last local line if it moved."""
        if self.fit is None:
            return None
        record = self.fit.to_dict(unit)
        record["measured"] = [[units * unit, peak] for units, peak in sorted(self.points)]
        if self.refined is not None:
            record["refined"] = self.refined.to_dict(unit)
        if self.aimed is not None:
            record["aimed_at_wall_bytes"] = self.aimed
        if self.settled is not None and self.units is not None:
            record["settled_above"] = {"batch_size": (self.units + 1) * unit, "past_limit_bytes": self.settled}
        if self.at_wall and self.units is not None:
            record["at_wall_above"] = {"batch_size": (self.units + 1) * unit}
        return record


def predictive(
    passes: Callable[..., bool],
    peak_of: Callable[[int], int | None],
    start: int,
    max_units: int,
    capacity: int,
    *,
    prior: LinearFit | None = None,
    above_first: bool = False,
    resident_of: Callable[[int], int | None] | None = None,
    short_of: Callable[[int], int | None] | None = None,
    usable_after: Callable[[int], int | None] | None = None,
    settle: bool = False,
    flushed_out: Callable[[int], bool] | None = None,
    flushed: Callable[[int], bool] | None = None,
) -> PredictOutcome:
    """Run the predictive search in units of ``multiple_of``. ``passes(units, purpose)`` runs
    (or recalls) a trial; ``peak_of(units)`` is the measured peak of a passing trial;
    ``capacity`` the bytes available. Returns the largest passing unit (None if unit 1
    failed), the fitted curve, and why the search fell back to binary, if it did.

    ``prior`` is an estimated curve (in units, e.g. from :mod:`autobatch.probe.tracing.estimate`): the first
    trial is then just below its boundary instead of at ``start``, and the line through that
    measured point with the prior's slope makes the first jump. ``above_first``: try the size
    above the line's boundary before the boundary (step 2 of the module's description).
    ``resident_of(units)``: the memory allocated as a passing trial's last step began (None
    if unknown), where ``peak_of`` is that step's peak; it enables the leap. ``short_of(units)``:
    a lower bound of the bytes a failed size needed beyond what fits (None if unknown: an
    estimate that runs high would overshoot into a passing trial); a refuted line then gallops
    down by at least that many bytes' worth of samples, never past the bracket's midpoint.
    ``usable_after(units)``: for a size that ran out of memory at the allocator's wall (its
    allocated figures left room for the allocation that failed), the allocated peak a size
    may reach: the capacity less the free pieces the allocator held but could not hand out
    (None if unknown); the line then aims there (:func:`~autobatch.probe.searching.bracket.close_bracket`).
    ``settle``: ``capacity`` is a limit past which every trial fails (an accelerator's peak
    limit), so where the line puts the size above a pass well past it, that size is not tried
    (:func:`~autobatch.probe.searching.bracket.close_bracket`; the outcome's ``settled``).
    ``flushed_out(units)``: a failed size's full trial kept flushing the allocator's cache; below
    it every trial is a full one (:func:`~autobatch.probe.searching.bracket.close_bracket`); ``flushed(units)``:
    a passing size's settle trial flushed in a step after its first (there, at the wall itself).
    """
    above = 1 if above_first else 0
    points: list[tuple[int, int]] = []  # (units, peak) of passing trials
    first = min(start, max_units)

    def record_pass(units: int) -> None:
        peak = peak_of(units)
        if peak is not None:
            points.append((units, peak))

    def hand_to_binary(reason: str, passed: int | None, failed: int | None) -> PredictOutcome:
        if passed is None:
            units = search.binary(passes, first, max_units)
        elif failed is None:
            units = search.binary(passes, passed, max_units)
        else:
            units = search.bisect(passes, passed, failed)
        return PredictOutcome(units, _secant(points, usable_only=False), reason, "binary", points)

    # -- 1. fit: from an estimate of the curve, or by growing geometrically --------------
    if prior is not None and prior.usable:
        seeded = _seed_from_prior(passes, record_pass, points, prior, capacity, max_units)
        if seeded is None:
            return hand_to_binary(
                "the estimated boundary and a size 20% below it both ran out of memory (the "
                "estimate was too high)", None, None,
            )
        lo, hi, fit = seeded
        if lo >= max_units:
            return PredictOutcome(lo, fit, None, "predict", points)
    else:
        below = _step_down_to_pass(passes, first)
        if below is None:
            return hand_to_binary(f"every trial from batch unit {first} down to 1 ran out of memory", None, None)
        lo, hi = below
        record_pass(lo)
        fit = None
        if hi is None:
            lo, hi, fit = _grow(passes, record_pass, points, peak_of, resident_of, first, max_units, capacity)
        fit = fit or _secant(points)
        if lo >= max_units:
            return PredictOutcome(lo, fit, None, "predict", points)
        if fit is None and hi is not None:  # a failure before any growing line: bisect until one exists
            lo, hi, fit = _bisect_for_line(passes, record_pass, points, lo, hi)
        if fit is None:
            if len(points) >= 2:
                (u0, p0), (u1, p1) = points[0], points[-1]
                reason = f"peak memory did not grow with the batch ({p0} B at unit {u0}, {p1} B at unit {u1})"
            else:
                reason = f"only one passing trial before the first OOM (unit {hi}); no line to fit"
            return hand_to_binary(reason, lo, hi)

    # -- 2 and 3. jump (along the bend, where the passes bend up clearly), then close the bracket --
    fit = bent_line(points, capacity) or fit
    closed = close_bracket(passes, record_pass, points, fit, lo, hi, max_units, capacity, above, short_of, usable_after,
                           settle, flushed_out, flushed)
    return PredictOutcome(closed.lo, fit, None, "predict", points, refined=closed.fit if closed.fit is not fit else None,
                          aimed=closed.capacity if closed.capacity < capacity else None, settled=closed.settled,
                          at_wall=closed.at_wall)


def _step_down_to_pass(passes, first: int) -> tuple[int, int | None] | None:
    """The first trial, stepped down while it runs out of memory (a ``start`` above the boundary):
    ``(the pass, the smallest failure above it or None)``, or None where unit 1 failed too. From
    a failure the line is then found by bisecting (:func:`_bisect_for_line`), not by binary search.

    Above :data:`SMALL_UNITS` a step halves; from there down it takes a quarter
    (:data:`STEP_DOWN`). A size above the boundary stops part-way through its first step, where a
    passing one runs its steps to the end, and on an accelerator a new size's first step also pays
    for its shapes (cuDNN's plans), so a search costs what its passes cost more than its failures.
    At a few samples the line cannot close the bracket (a sample is an eighth of the size or more)
    and bisecting back up from a halving's pass, up to half the boundary below it, runs another
    pass or two; a quarter lands within a quarter. A SegFormer (MiT-b2) under 8 GiB on an H200,
    boundary 6, from the default first trial, 8: halving passed 4 then 6 (3.3-5.7 s each: the depthwise
    convolutions' plans), a quarter passes 6 alone. From 8 a quarter tries 6, 4, 3, 2, 1: as many
    passes as halving or fewer at every boundary, and two more failures where only 1 fits. Above
    it (a ``start`` set high) halving reaches the boundary in fewer failures, and the line through
    two passes closes the bracket however wide."""
    units, failed = first, None
    while not passes(units, "fit"):
        if units == 1:
            return None
        below = units // 2 if units > SMALL_UNITS else math.floor(units * STEP_DOWN)
        units, failed = max(1, min(units - 1, below)), units
    return units, failed


def _grow(passes, record_pass, points, peak_of, resident_of, first: int, max_units: int, capacity: int):
    """Step 1 without a prior: from a passing ``first``, grow geometrically (or leap, from
    what one passing trial guarantees) until a line through the passing points says the
    boundary is near or a size fails. Returns ``(lo, hi, fit)``: the largest pass, the
    smallest failure (None: none yet) and the line (None: no usable one yet)."""
    lo, hi = first, None
    fit = None
    corner_leaps = 0  # a line from a corner grows by one leap at most (steps of allocator rounding look alike)
    while lo < max_units:
        fit = _secant(points)
        leap = None if resident_of is None else leap_size(lo, peak_of(lo), resident_of(lo), capacity)
        cornered = fit is not None and corner_leaps == 0 and (
            _from_corner(points, fit) or _past_guarantee(fit, leap, capacity))
        if fit is not None and not cornered and fit.predict_max(capacity) <= lo * JUMP_RATIO:
            break
        if hi is not None and not cornered:
            leap = None  # below a failure the ladder grows; a leap only corrects a corner's line
        # no usable line yet (one point, or flat), it says the boundary is far, or it starts
        # where a flat stretch ends (too shallow: it would overshoot): grow
        if cornered and (leap is None or leap <= lo):
            break  # nothing safer to grow by: jump, and let the closing loop correct the line
        if leap is not None and (cornered or (fit is None and len(points) == 1)):
            units = max(leap, lo + 1)  # the bound one trial guarantees is all there is to go on
            corner_leaps += cornered
        else:  # a line says the boundary is far: the ladder, or a leap that reaches further
            units = max(leap or 0, lo * GROWTH)
        leaping = leap is not None and units == leap and leap > lo * GROWTH
        units = min(units, max_units)
        if hi is not None and units >= hi:
            break  # the ladder reached a failed leap
        if not passes(units, "fit"):
            hi = units
            if leaping:
                continue  # the curve bends up: the plain ladder goes on below the leap
            break
        record_pass(units)
        lo = units
        fit = None
    return lo, hi, fit


def _past_guarantee(fit: LinearFit, leap: int | None, capacity: int) -> bool:
    """Whether ``fit`` puts the boundary more than ``SHALLOW`` past what the largest pass
    guarantees (``leap``, :func:`leap_size`, is ``LEAP_FRACTION`` of it). That guarantee
    counts every byte the step added above its resident memory as growing with the batch, so
    on a straight curve it is a lower bound that the true line passes only by the step's
    fixed growth (gradients, workspaces) at the pass's size. A line farther past rose more
    slowly than the curve does: its lower point's peak did not grow with the batch (a corner
    seen with two points; at small sizes the optimizer step's temporaries make the peak).
    ViT-B/32 under AdamW on an H200 (8 GiB cap): the line through 8 and the leap's 74 said 513;
    with the resident memory the leap from 8 implies, 74 guaranteed about 343; the maximum was 382."""
    if leap is None or fit.slope <= 0:
        return False
    return fit.predict_max(capacity) > leap / LEAP_FRACTION * (1 + SHALLOW)


def _bisect_for_line(passes, record_pass, points, lo: int, hi: int):
    """Bisect ``(lo, hi)`` until a passing size and an earlier one give a growing line (the
    peak was flat up to ``lo``: an optimizer step's temporaries, allocator blocks). Returns
    ``(lo, hi, fit)``, fit None when the bracket closed first."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if not passes(mid, "bisect"):
            hi = mid
            continue
        record_pass(mid)
        lo = mid
        fit = _secant(points)
        if fit is not None:
            return lo, hi, fit
    return lo, hi, None


def leap_size(units: int, peak: int, resident: int | None, capacity: int) -> int | None:
    """``LEAP_FRACTION`` of the largest size in units that one passing trial at ``units``
    guarantees, or None when it guarantees nothing beyond ``units``.

    ``peak`` is the allocated peak of the trial's last step, ``resident`` what was allocated
    as that step began. On a memory curve ``resident + fixed + slope * b`` the trial measured
    ``fixed + slope * units`` above the resident memory; spreading all of it over the samples
    overstates the slope, so ``(capacity - resident) / (peak - resident) * units`` samples
    still fit (to the extent that the curve is straight).
    """
    if resident is None:
        return None
    grown, room = peak - resident, capacity - resident
    if grown <= 0 or room <= grown:
        return None
    return math.floor(units * room / grown * LEAP_FRACTION)


def _seed_from_prior(passes, record_pass, points, prior: LinearFit, capacity: int, max_units: int):
    """First trials from an estimated curve: ``PRIOR_BELOW`` under its boundary, then (if that
    ran out of memory) 20 % lower. Returns ``(lo, hi, fit)`` for the closing loop, the fit
    being the prior's slope through the measured point, or None when both trials failed."""
    predicted = prior.predict_max(capacity)
    first = math.floor(min(predicted, max_units) * (1 - PRIOR_BELOW))
    if predicted * (1 - PRIOR_BELOW) >= max_units:
        first = max_units  # the cap fits with room to spare: try it directly
    hi = None
    for guess in (first, math.floor(first * 0.8)):
        guess = max(1, min(guess, max_units))
        if hi is not None and guess >= hi:
            break
        if passes(guess, "estimate"):
            record_pass(guess)
            fit = prior
            if points:
                units, peak = points[-1]
                fit = LinearFit(intercept=peak - prior.slope * units, slope=prior.slope, points=[(units, peak)])
            return guess, hi, fit
        hi = guess
    return None
