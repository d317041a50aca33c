"""Running a search strategy over real trials: the boundary, the confirming pass, the margin.

:func:`run_search` turns a :class:`~autobatch.probe.trial.TrialRunner` and a strategy name into
a :class:`~autobatch.ProbeResult`: it runs the strategy in units of ``multiple_of``
(:mod:`~autobatch.probe.searching.predict` for ``predict``/``auto``, :mod:`~autobatch.probe.searching.strategies`
for the others), makes sure the answer passed a full trial, takes the margin off and
verifies it, and raises :class:`~autobatch.NoBatchFitsError` with the memory figures when
nothing fits.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ...errors import NoBatchFitsError
from ...memory.allocator import expandable_segments_on
from ...memory.devices import SimulatedDeviceMemory
from ...memory.diagnostics import memory_diagnostics
from .. import arguments
from . import strategies
from ..tracing.estimate import BatchEstimate
from ..fresh_layout import FreshLayout, in_fresh_layout
from .line import LinearFit
from .measured_wall import below_late_failures, below_measured_wall, late_failures_note, measured_wall_note
from .predict import predictive
from ..result import ProbeResult
from ..settling import step_down
from ..trial import TrialRunner
from ..trial_notes import growth_hint
from .untried import ceiling_note, halving_first_note, untried_above_notes

__all__ = ["run_search", "peak_limit", "allocator_headroom", "max_units_of"]


def run_search(
    runner: TrialRunner,
    *,
    strategy: str,
    start: int | None,
    max_batch: int | None,
    margin: float,
    multiple_of: int,
    device_name: str,
    capacity: int | None,
    prior: tuple[LinearFit, BatchEstimate] | None = None,
    confirm: bool = False,
    hand_loop: bool = False,
    fresh_layout: FreshLayout | None = None,
) -> ProbeResult:
    """Run the strategy in units of ``multiple_of``, apply the margin, build the result.

    A size whose next size up already failed (or that is ``max_batch``) may be the answer,
    so its trial runs all ``steps_per_trial`` steps; at the end, an answer without such a
    full pass gets one (:func:`_confirm`). With ``confirm`` (real accelerators) that full pass
    must also come after the last OOM trial, so the size is known to train in the state
    training will start from: after OOMs the allocator's cache and cuDNN's choice of
    algorithms (it falls back to ones with smaller workspaces when memory is short) differ.
    ``hand_loop`` (a plain callable: the user's own loop trains it, and cannot replay a step):
    under expandable segments, an answer whose next size up failed still flushing steps one
    size lower (:func:`below_moving_wall`). ``fresh_layout`` (a hand loop, whose first step
    makes its state afresh): where it says so (:mod:`~autobatch.probe.fresh_layout`), the answer
    must pass a settle trial in that layout too (:func:`in_fresh_layout`).
    """
    used = "predict" if strategy == "auto" else strategy
    max_units = max_units_of(max_batch, multiple_of)
    start_units = _start_units(used, start, max_batch, multiple_of)

    def passes(units: int, purpose: str = "search") -> bool:
        above = runner.outcomes.get((units + 1) * multiple_of)
        final = units >= max_units or above is False or purpose in ("margin", "wall", "edge")
        return runner(units * multiple_of, purpose, final=final)

    fit = fallback_reason = None
    if used == "predict":
        found, used, fallback_reason, fit = _predict(runner, passes, start_units, max_units, multiple_of, capacity, prior)
    else:
        found = strategies.STRATEGIES[used](passes, start_units, max_units)
    if found is not None:
        found = _confirm(runner, found, multiple_of, after_last_oom=confirm)
    if found is None:
        _raise_no_fit(runner, multiple_of, device_name, capacity)
    largest_passed = found * multiple_of
    confirmed = lambda units: _confirm(runner, units, multiple_of, after_last_oom=confirm)  # noqa: E731
    cleared = below_measured_wall(runner, found, multiple_of, capacity, confirmed)
    clean = None if cleared is None else below_late_failures(runner, cleared, multiple_of, confirmed)
    if clean is None:
        _raise_no_fit(runner, multiple_of, device_name, capacity)
    walled = below_moving_wall(runner, clean, multiple_of, after_last_oom=confirm) if hand_loop else clean
    below = walled
    if walled is not None and fresh_layout is not None and confirm and fresh_layout.needed(capacity):
        below = in_fresh_layout(runner, walled, multiple_of, fresh_layout,
                                lambda units: _confirm(runner, units, multiple_of, after_last_oom=True))
    if below is None:
        _raise_no_fit(runner, multiple_of, device_name, capacity)
    chosen = _apply_margin(runner, passes, below, margin, multiple_of)
    if chosen is None:
        _raise_no_fit(runner, multiple_of, device_name, capacity)
    failed_above = [b for b in runner.failed_sizes if b > largest_passed]
    notes = []
    if cleared != found:
        notes.append(measured_wall_note(runner, largest_passed, cleared * multiple_of, capacity))
    if clean != cleared:
        kept = runner.passed_record(clean * multiple_of)
        notes.append(late_failures_note(cleared * multiple_of, clean * multiple_of, kept is None or not kept.flushes))
    if walled != clean:
        notes.append(moving_wall_note(clean * multiple_of, walled * multiple_of, (found + 1) * multiple_of))
    if below != walled:
        notes.append(f"{below * multiple_of}, below {walled * multiple_of}: the answer must also pass beside the optimizer "
                     f"state made in its first step, as training from scratch makes it, and {walled * multiple_of} "
                     "did not")
    notes.extend(untried_above_notes(runner, fit, largest_passed, failed_above, multiple_of))
    if max_batch is None and found >= max_units:
        notes.append(ceiling_note(runner.records, max_units * multiple_of))
    elif used == "halving" and found == start_units < max_units:  # halving stops at its first pass
        notes.append(halving_first_note(largest_passed, max_batch))
    return ProbeResult(
        batch_size=chosen * multiple_of,
        strategy=strategy,
        strategy_used=used,
        trials=runner.records,
        capacity_bytes=capacity,
        elapsed_s=0.0,
        margin=margin,
        multiple_of=multiple_of,
        max_batch=max_batch,
        largest_passed=largest_passed,
        smallest_failed=min(failed_above) if failed_above else None,
        device=device_name,
        fit=fit,
        fallback_reason=fallback_reason,
        notes=notes,
    )


def _start_units(used: str, start: int | None, max_batch: int | None, multiple_of: int) -> int:
    """The first size tried, in units of ``multiple_of`` (see ``find_max_batch``'s ``start``)."""
    if start is None:
        if used == "halving":
            start = max_batch or arguments.HALVING_DEFAULT_START
        elif used == "predict":
            start = max(multiple_of, arguments.PREDICT_DEFAULT_START // multiple_of * multiple_of)
        else:
            start = multiple_of
    return max(1, start // multiple_of)


def max_units_of(max_batch: int | None, multiple_of: int) -> int:
    """The largest size the search may try, in units: ``max_batch`` when given, else
    ``arguments.SEARCH_CEILING`` samples."""
    if max_batch is not None:
        return max_batch // multiple_of
    return max(1, arguments.SEARCH_CEILING // multiple_of)


def _predict(runner: TrialRunner, passes, start_units: int, max_units: int, multiple_of: int, capacity, prior):
    """``predict``'s search: fit the memory line, leap to its boundary, close the gap.
    Returns ``(units, strategy used, fallback reason, fit record)``."""

    def peak_of(units: int) -> int | None:
        return runner.peak_of(units * multiple_of)

    def resident_of(units: int) -> int | None:
        record = runner.passed_record(units * multiple_of)
        return None if record is None else record.resident_bytes

    # the line aims where trials stop passing: on an accelerator, at the peak limit
    usable = capacity if runner.peak_limit is None else runner.peak_limit
    outcome = predictive(
        passes, peak_of, start_units, max_units, usable, prior=None if prior is None else prior[0],
        above_first=runner.search_steps < runner.steps,  # a full pass costs more than an OOM
        resident_of=resident_of, short_of=lambda units: runner.short_of(units * multiple_of),
        usable_after=lambda units: _below_wall(capacity, runner.wall_of(units * multiple_of)),
        # on an accelerator a step past the peak limit fails: the line may settle the last size
        settle=runner.peak_limit is not None,
        flushed_out=lambda units: runner.flushed_out(units * multiple_of),
        flushed=lambda units: bool(getattr(runner.passed_record(units * multiple_of), "flushes", 0)),
    )
    fit = outcome.fit_record(multiple_of)
    if fit is not None and usable != capacity:
        fit["allocator_headroom_bytes"] = capacity - usable
    return outcome.units, outcome.strategy_used, outcome.fallback_reason, fit


def _below_wall(capacity: int | None, wall: int | None) -> int | None:
    """The allocated peak a size may reach where a failed trial measured the allocator's wall:
    the (agreed) capacity less what the allocator held in pieces too small to use."""
    return None if capacity is None or wall is None else capacity - wall


def peak_limit(memory, capacity: int | None) -> int | None:
    """The largest allocated peak a passing trial may reach: on an accelerator, the capacity
    less :func:`allocator_headroom`; on the simulated device (no caching allocator) no limit."""
    if capacity is None or isinstance(memory, SimulatedDeviceMemory):
        return None
    capped = getattr(memory, "cap_binds", lambda: False)()
    return capacity - allocator_headroom(capacity, getattr(memory, "device", None), capped=capped)


def allocator_headroom(capacity: int, device: torch.device | None, *, capped: bool) -> int:
    """The bytes a passing step's allocated peak must leave free on an accelerator:
    ``arguments.ALLOCATOR_HEADROOM`` of the capacity, or ``arguments.EXPANDABLE_HEADROOM_BYTES``
    if that is less where expandable segments are on (CUDA) and the per-process cap bounds the
    capacity (``capped``). Fixed segments need the percent for free pieces that sit where no
    large request fits; expandable ones remap free pages where a request fits, so only partly
    used pages are lost. Without a binding cap the capacity is the driver's free memory, which
    also shrinks by what is allocated outside the caching allocator after the probe measured it
    (measured on an H200, the CLI's default uncapped: with two pages of headroom 39147 passed a
    step, then ran out of memory in its second, 19.12 GiB asked with 19.11 GiB free)."""
    fixed = int(capacity * arguments.ALLOCATOR_HEADROOM)
    if capped and expandable_segments_on(device):
        return min(fixed, arguments.EXPANDABLE_HEADROOM_BYTES)
    return fixed


def below_moving_wall(runner: TrialRunner, found: int, multiple_of: int, *, after_last_oom: bool) -> int | None:
    """The answer for a hand loop (in units): one size below ``found`` where the allocator's
    segments are expandable and the next size up failed its settle trial still flushing (at the
    allocator's wall in the trials' layout), confirmed by a full trial; else ``found``.

    Why: the wall moves with the process. A new process lays its memory out afresh (the
    optimizer's state made among its first step's activations, the matmul libraries'
    workspaces made during that step), and there the wall can sit one size lower than the
    trials, whose state and workspaces were made at their first, small trial. Measured on an
    H200 (ViT-B/16 as a plain callable, bf16, AdamW, 8 GiB cap, ``scripts/diag_fresh_layout.py
    --cold``): the trials flushed from 103 and passed 102 without a flush, and in new processes
    102 flushed its cache at nearly every step and ran out of memory at step 23-32, while 101
    never flushed; with the optimizer's state and the libraries' handles made before the first
    step, 102 trained. A ``TrainStep``'s Runner at 102 trained 200 steps in new processes (and
    would replay a step that ran out of memory), so only a hand loop, which cannot, steps down.
    """
    if found <= 1 or not runner.expandable or not runner.flushed_out((found + 1) * multiple_of):
        return found
    return _confirm(runner, found - 1, multiple_of, after_last_oom=after_last_oom)


def moving_wall_note(passed: int, answer: int, flushing: int) -> str:
    """Why a hand loop's answer is one size below the largest that passed (:func:`below_moving_wall`)."""
    return (f"{answer}, one size below {passed}, which passed: with expandable segments {flushing} kept flushing the "
            f"allocator's cache at the wall, and a new process, which lays its memory out afresh, meets that wall "
            f"up to one size lower; a hand loop cannot replay a step that runs out of memory (autobatch's Runner can)")


def _confirm(runner: TrialRunner, found: int, multiple_of: int, *, after_last_oom: bool) -> int | None:
    """Run a full trial of the answer unless one passed (after the last OOM, with
    ``after_last_oom``); step down while it fails, then bisect back up (:func:`_bisect_up`).

    Each step down is what the failure measured (:func:`~autobatch.probe.settling.step_down`), at most two percents, and
    from the third failure in a row a gallop (:func:`_stride`): bytes over measured at the
    allocator's wall are its pieces, which need not shrink with the batch. Measured on an H200 (VGG-16 as a plain
    callable, 8 GiB cap): confirmations from 124 down failed one unit at a time, then 117's
    steady step left 3.2 GiB in split pieces, 2.1 GiB over, and a step of that many units'
    bytes went to 70, 0.53 of the 132 that ran three steps."""
    if runner.confirmed(found * multiple_of, after_last_oom=after_last_oom):
        return found
    units, hi, failures, priced = found, None, 0, False
    while units >= 1:
        record = runner.run(units * multiple_of, "confirm", settle=runner.settle_final)
        if record.passed:
            return _bisect_up(runner, units, None if priced else hi, multiple_of, after_last_oom)
        hi, failures = units, failures + 1
        stride = _stride(step_down(record, units), max(1, units // 100), failures)
        # a step of at most two percents that the failure measured priced what lies between: no bisection
        priced = failures <= 2 and units - stride >= 1
        units = max(units - stride, 1 if units > 1 else 0)
    return None


def _stride(measured: int, percent: int, failures: int) -> int:
    """The step down after ``failures`` failed confirmations in a row: what the last one measured,
    within one to two percents, for the first two; then a gallop of four, eight, ... percents."""
    if failures <= 2:
        return min(max(measured, percent), 2 * percent)
    return percent << (failures - 1)


def _bisect_up(runner: TrialRunner, lo: int, hi: int | None, multiple_of: int, after_last_oom: bool) -> int | None:
    """The largest size that passes a full trial between ``lo`` (passed one) and ``hi`` (failed
    one; None: nothing to bisect), to within a percent (one unit below 100 units); confirmed
    again where a later trial ran out of memory (``after_last_oom``)."""
    while hi is not None and hi - lo > max(1, hi // 100):
        mid = (lo + hi) // 2
        if runner.run(mid * multiple_of, "confirm", settle=runner.settle_final).passed:
            lo = mid
        else:
            hi = mid
    if runner.confirmed(lo * multiple_of, after_last_oom=after_last_oom):
        return lo
    return _confirm(runner, lo, multiple_of, after_last_oom=after_last_oom)


def _apply_margin(runner: TrialRunner, passes, found_units: int, margin: float, multiple_of: int) -> int | None:
    """Shrink the boundary by ``margin`` and verify the smaller size with a full trial (one that
    ran every step; a search trial of that size that ran fewer is run again in full).

    Memory very nearly grows with batch size, so the verification almost always passes; if
    it does not (a pathological step), halve further until one does.
    """
    if margin == 0:
        return found_units
    units = max(1, math.floor(found_units * multiple_of * (1 - margin)) // multiple_of)
    while units >= 1:
        size = units * multiple_of
        if size not in runner.outcomes:
            if passes(units, "margin"):
                return units
        elif runner.outcomes[size] and (runner.confirmed(size, after_last_oom=False)
                                        or runner.run(size, "margin", settle=runner.settle_final).passed):
            return units
        units //= 2
    return None


def _raise_no_fit(runner: TrialRunner, multiple_of: int, device_name: str, capacity: int | None):
    failures = [record for record in runner.records if not record.passed]
    smallest = min(failures, key=lambda record: record.batch_size)
    hint = None if smallest.batch_size != multiple_of else growth_hint(  # failed down to the smallest size
        [r for r in runner.records if r.passed], smallest.batch_size, runner.memory.allocated())
    fresh = [r for r in runner.records if r.purpose == "fresh"]
    if hint is None and fresh and not any(r.passed for r in fresh) and any(r.passed for r in runner.records):
        passed = max(r.batch_size for r in runner.records if r.passed)
        hint = (f"{passed} passed in the probe's own layout, but no size passed beside optimizer state made in its "
                "first step, as training from scratch makes it (autobatch.probe.fresh_layout): create the "
                "optimizer's state before training (one step at a small batch, or load a checkpoint), or make the "
                "allocator's segments expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), so that a large "
                "request grows a segment instead of needing a free one whole.")
    if hint is None and multiple_of > 1:
        hint = (
            f"multiple_of={multiple_of} makes {multiple_of} the smallest batch tried; lower "
            "multiple_of, or try gradient accumulation, activation checkpointing or lower precision."
        )
    raise NoBatchFitsError(
        batch_size=smallest.batch_size,
        capacity_bytes=capacity,
        peak_bytes=smallest.peak_bytes,
        device=device_name,
        last_error=smallest.error,
        hint=hint,
        diagnostics=memory_diagnostics(runner.memory, failed_trial=smallest),
    )
