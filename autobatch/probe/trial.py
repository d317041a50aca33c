"""One probe trial: run the user's step at a batch size, catch an OOM, measure, clean up."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable, ContextManager

from ..memory.allocator import expandable_segments_on
from ..memory.devices import DeviceMemory
from ..memory.oom import free_memory, is_oom_error, requested_bytes
from ..memory.simulated import host_memory
from ..memory.units import format_bytes
from ..memory.workspaces import release_workspaces
from .autotune import Autotune
from .caught import CaughtWatch, caught_error
from .collection import Leftover
from .peak_guard import drain_backward, raised_by_guard
from .trial_notes import with_trial_note
from .pinned_state import PinnedState, fits
from .records import TrialRecord, notify, watch_trials
from .settling import (WALL_BYTES, FlushCount, flushing_error, growing, most_steps, reserved_bound, split_bytes,
                       wall_excess)

__all__ = ["TrialRecord", "TrialRunner", "watch_trials"]

log = logging.getLogger("autobatch")


class TrialRunner:
    """Runs trials of ``fn`` and remembers every outcome.

    A full trial calls ``fn(batch_size)`` ``steps`` times, a search trial ``search_steps`` times
    (default: ``steps``): only the answer needs what a repeated step reveals (lazy state, memory
    growing), so trials up to the first pass and those marked ``final`` run full; the caller
    confirms its answer with :meth:`confirmed`. With ``settle_final`` (accelerators) a ``final``
    trial settles (:meth:`run`: cuDNN autotuning as set, more steps while the allocator settles).

    Any out-of-memory error (by :func:`is_oom_error`) fails the trial, and so does a step
    whose allocated peak passed ``peak_limit`` (on an accelerator, the capacity less the
    caching allocator's headroom, :data:`~autobatch.probe.ALLOCATOR_HEADROOM`); ``guard``, when
    given, stops such a step part-way (:mod:`~autobatch.probe.peak_guard`). Every other
    exception propagates unchanged at once. Memory is released *after* the ``except`` block has
    been left, so the traceback no longer pins the failed step's tensors
    (:meth:`_clean_up_after_oom`, :meth:`_garbage_was_in_the_way`).

    A size already tried is answered from memory. Peaks are read step by step, so the last
    step's own figures are known too. ``agree``, when given, turns the local record into the one
    every rank shares (:func:`~autobatch.dist.probe.agree_trial`), after the memory is freed.
    ``pinned`` lets a settle trial that ran out of memory at the allocator's wall beside
    optimizer state made at a nearby size run once more without it
    (:mod:`~autobatch.probe.pinned_state`). ``hand_loop``: a loop that cannot replay a step
    trains the answer (:meth:`_flushes_matter`); its trials start without the cuBLAS
    workspaces, as a new process's first step (:func:`~autobatch.memory.workspaces.release_workspaces`).
    ``layout`` (a hand loop's) lays the optimizer state the trials made out before each settle
    trial, as a run resumed from a checkpoint has it (:mod:`~autobatch.probe.promise`).
    ``before_trial`` runs as each trial begins (the snapshot's ``undo_forward``); so does ``held_growth``
    (:meth:`~autobatch.memory.lazy_state.LazyStateWatch.growth_from_now`: live state a failed trial leaves)."""

    def __init__(
        self,
        fn: Callable[[int], object],
        memory: DeviceMemory,
        steps: int,
        after_oom: Callable[[], None] | None = None,
        agree: Callable[[TrialRecord], TrialRecord] | None = None,
        search_steps: int | None = None,
        peak_limit: int | None = None,
        autotune: "Autotune | None" = None,
        settle_final: bool = False,
        settle_more: Callable[[bool], bool] | None = None,
        guard: ContextManager[object] | None = None,
        pinned: PinnedState | None = None,
        hand_loop: bool = False,
        layout: Callable[[], object] | None = None,
        before_trial: Callable[[], object] | None = None,
        held_growth: Callable[[], Callable[[], int]] | None = None,
    ) -> None:
        self.fn, self.hand_loop, self.layout, self.before_trial = fn, hand_loop, layout, before_trial
        self.first_placed: str | None = None  # why the first trial has its size (find.py: an estimate placed it)
        self.held_growth = held_growth or (lambda: lambda: 0)
        self._fresh_workspaces = getattr(memory, "device", None) if hand_loop else None
        self.pinned, self.guard = pinned, guard
        self.settle_more = settle_more if settle_more is not None else (lambda more: more)
        self.autotune = autotune
        self.settle_final, self.peak_limit, self.memory = settle_final, peak_limit, memory
        self.steps, self.search_steps = steps, steps if search_steps is None else min(search_steps, steps)
        self.after_oom, self.agree = after_oom, agree
        self.records: list[TrialRecord] = []
        self.outcomes: dict[int, bool] = {}
        self._settled: set[int] = set()  # ids of records of settle trials
        self._leftover = Leftover()  # memory failed trials left held (collection.py)
        self._flush_count = FlushCount()
        self.expandable = bool(expandable_segments_on(getattr(memory, "device", None)))  # CUDA's allocator setting
        self._ran_out: set[int] = set()  # ids of records of trials that ran out of memory or were stopped

    def __call__(self, batch_size: int, purpose: str = "search", *, final: bool = False) -> bool:
        """Whether ``batch_size`` trains; runs a trial unless it was tried already.
        ``final``: this size may be the answer, so the trial runs all ``steps``."""
        if batch_size not in self.outcomes:
            # full until one passed: an OOM trial made no lazy state (Adam's moments) to measure beside
            steps = self.steps if final or not any(r.passed for r in self.records) else self.search_steps
            self.run(batch_size, purpose, steps=steps, settle=final and self.settle_final)
        return self.outcomes[batch_size]

    def run(self, batch_size: int, purpose: str = "search", *, steps: int | None = None, settle: bool = False,
            layout: Callable[[], object] | None = None) -> TrialRecord:
        """Run a trial even if this size was tried before; ``steps`` calls of ``fn`` (default: a
        full trial). ``settle`` (a size that may be the answer): more steps while the allocator
        settles (:mod:`~autobatch.probe.settling`), the state laid out by ``layout`` (default: the runner's), and
        with ``purpose="confirm"`` cuDNN autotuning as the user set it. A trial stops early once
        its allocated peak is above ``peak_limit``."""
        steps = self.steps if steps is None else steps
        notify(batch_size, purpose, None)
        # autotuning (seconds per new shape) only where the answer is confirmed: a size that
        # fails untuned never costs an autotuning pass, and the answer is known to train tuned
        tuned = settle and purpose == "confirm" and self.autotune is not None and self.autotune.wanted
        prepare = (layout or self.layout) if settle else None
        error = self._attempt_as(batch_size, steps, settle, tuned, prepare)
        if error is not None and self._garbage_was_in_the_way():
            error = self._attempt_as(batch_size, steps, settle, tuned, prepare)
        if error is not None and settle and self._unpinned(batch_size, error):
            error = self._attempt_as(batch_size, steps, settle, tuned, prepare)
        steps = self._steps_run
        seconds = time.perf_counter() - self._started
        peak, reserved = self._peak, self._reserved
        ran_out = error is not None
        over_bytes = None
        if not ran_out and self.peak_limit is not None and peak > self.peak_limit:
            over_bytes = peak - self.peak_limit
            error = (
                f"too close to the capacity: allocated peak {format_bytes(peak)} is above "
                f"{format_bytes(self.peak_limit)}, the capacity less the caching allocator's headroom"
                + (" (the step was stopped there, part-way)" if self._stopped else "")
            )
        flushed_out = not ran_out and error is None and settle and bool(self._flushes_matter()) and self._flush_count.flushing
        if flushed_out:
            error = flushing_error(self._flush_count.flushes, steps, self._flushes_matter())
        excess = self._wall_excess() if not ran_out and error is None else 0
        if excess:
            error = (
                f"at the allocator's wall: allocated peak {format_bytes(self._step_peak)} plus "
                f"{format_bytes(self._inactive_split)} left in split blocks the allocator cannot return leaves "
                f"less than {format_bytes(WALL_BYTES)} of the {format_bytes(self.memory.capacity())} capacity; "
                "such a size trains only while the free pieces happen to sit where the next request fits"
            )
            over_bytes = excess
        step_peak = self._step_peak if error is None or over_bytes else None
        resident = self._resident if error is None or over_bytes else None
        wall = None
        if ran_out:
            requested = requested_bytes(error)  # "Tried to allocate 2.00 GiB", parsed once for both figures
            over_bytes, wall = self._shortfall(requested), self._wall(requested)
        if ran_out or self._stopped:  # a step stopped part-way left what an OOM leaves
            self._clean_up_after_oom()
        if self.pinned is not None:  # after the clean-up, which drops state a failed optimizer step half-made
            self.pinned.observe(batch_size)
        record = TrialRecord(
            batch_size, error is None, peak, seconds, purpose, error, reserved, steps, step_peak, resident,
            self._fragmentation if error is None else None, self._inactive_split,
            tuned if self.autotune and self.autotune.wanted else None, over_bytes, wall, self._flush_count.flushes,
            flushed_out,
        )
        if self.agree is not None:
            record = self.agree(record)
        if settle:
            self._settled.add(id(record))
        if ran_out or self._stopped:
            self._ran_out.add(id(record))
        self.records.append(record)
        self.outcomes[batch_size] = record.passed
        log.info("trial %-7s batch=%d %s peak=%s %.3fs", purpose, batch_size, "passed" if record.passed else "OOM",
                 format_bytes(peak), seconds)
        notify(batch_size, purpose, record)
        return record

    def flushed_out(self, batch_size: int) -> bool:  # its settle trial failed still flushing (on some rank)
        return any(r.flushed_out for r in self.records if r.batch_size == batch_size)

    def confirmed(self, batch_size: int, *, after_last_oom: bool) -> bool:
        """Whether a full trial of ``batch_size`` passed (with ``after_last_oom``: after the
        last trial that ran out of memory, so it is known to train in the state the allocator
        was left in; cuDNN also falls back to smaller workspaces when memory is short). A trial
        that failed having run its steps (still flushing, too close, at the wall) left no such
        state (:meth:`ran_out`): a pass before it stands."""
        autotuned = self.autotune is not None and self.autotune.wanted
        for record in reversed(self.records):
            if (
                record.batch_size == batch_size and record.passed and (record.steps or self.steps) >= self.steps
                and (record.autotuned or not autotuned)
                and (id(record) in self._settled or not self.settle_final)
            ):
                return True
            if after_last_oom and self.ran_out(record):
                return False
        return False

    def ran_out(self, record: TrialRecord) -> bool:
        """Whether ``record``'s trial ran out of memory or was stopped part-way (under rank agreement: failed)."""
        return not record.passed and (self.agree is not None or id(record) in self._ran_out)

    def _attempt_as(self, batch_size: int, steps: int, settle: bool, tuned: bool, prepare=None) -> str | None:
        """:meth:`_attempt` under the trial's cuDNN flags; a settle trial may run up to
        :func:`~autobatch.probe.settling.most_steps` steps."""
        most = most_steps(steps, tuned) if settle else steps
        with self.autotune.trial(tuned) if self.autotune is not None else nullcontext():
            return self._attempt(batch_size, steps, most, prepare)

    def _unpinned(self, batch_size: int, error: str) -> bool:
        """Whether a settle trial that just failed runs again: it ran out of memory at the allocator's
        wall beside optimizer state made at a nearby size, now dropped, and the passing sizes put its
        peak under the limit (:mod:`~autobatch.probe.pinned_state`). Not under rank agreement."""
        at_wall = self.pinned is not None and self.agree is None and self._wall(requested_bytes(error)) is not None
        at_wall = at_wall and fits(batch_size, {b: self.peak_of(b) for b in self.passed_sizes}, self.peak_limit)
        dropped = at_wall and self.pinned.drop_if_pinning(batch_size)
        if dropped and self.after_oom is not None:
            self.after_oom()  # what the failed attempt left (half-built gradients), as after any OOM
        return dropped

    def _shortfall(self, requested: int | None) -> int | None:
        """For a trial that ran out of memory: bytes its step needed beyond what a passing step
        may allocate (the peak limit; the capacity where there is none), None when unknown. What was
        allocated when it failed plus the failed allocation (``requested``) is a lower bound. Where it
        leaves room, the failure was the allocator's (its reserved peak plus the request passed the
        capacity): an estimate, recorded but never a search's stride."""
        if requested is None or self._failed_at is None:
            return None
        usable = self.peak_limit if self.peak_limit is not None else self.memory.capacity()
        short = self._failed_at + requested - usable
        if short <= 0 and self._reserved_at_failure is not None:
            short = self._reserved_at_failure + requested - self.memory.capacity()
        return short if short > 0 else None

    def _wall(self, requested: int | None) -> int | None:
        """For a trial that ran out of memory although allocated bytes plus the failed allocation
        stayed under the peak limit: the step's reserved less allocated peak (unusable pieces)."""
        if requested is None or self._failed_at is None or self.peak_limit is None or not self._fragmentation:
            return None
        return self._fragmentation if self._failed_at + requested <= self.peak_limit else None

    def wall_of(self, batch_size: int) -> int | None:
        """:attr:`TrialRecord.wall_bytes` of the latest failed trial at ``batch_size`` (None: none,
        or no figure): what the allocator held in pieces too small for the failed allocation."""
        return getattr(self._latest_failure(batch_size), "wall_bytes", None)

    def short_of(self, batch_size: int) -> int | None:
        """:attr:`TrialRecord.over_bytes` of the latest failed trial at ``batch_size`` where it
        bounds the bytes that size needs beyond what fits from below (``_shortfall``); None where
        only the allocator's estimate (``wall_bytes``) is known, which can run high."""
        failed = self._latest_failure(batch_size)
        return None if failed is None or failed.wall_bytes is not None else failed.over_bytes

    def _latest_failure(self, batch_size: int) -> TrialRecord | None:
        return next((r for r in reversed(self.records) if r.batch_size == batch_size and not r.passed), None)

    def _clean_up_after_oom(self) -> None:
        """Drop what the failed step left (``after_oom``; its backward queue, drained in host memory that a spent
        simulated budget cannot refuse), collect its young garbage, return the cached blocks. A full collection (0.12 s)
        waits for a later trial failing beside the leftover (:meth:`_garbage_was_in_the_way`); with ranks, at once where
        the young ones left memory held (:mod:`~autobatch.probe.collection`). Live: optimizer state, ``held_growth``."""
        if self.after_oom is not None:
            self.after_oom()
        with host_memory():
            drain_backward()
        release_workspaces(self._fresh_workspaces)  # remade by the failed step: not its leftover
        kept = self._baseline + self._growth()
        if self.memory.allocated() <= kept:
            return
        self._leftover.after_failure(self.memory.allocated, kept, full_if_held=self.agree is not None)

    def _garbage_was_in_the_way(self) -> bool:
        """Whether a trial that just failed runs again beside garbage an earlier one left
        (:meth:`~autobatch.probe.collection.Leftover.in_the_way`); never under rank agreement."""
        return self.agree is None and self._leftover.in_the_way(self.memory.allocated, self.after_oom)

    def _attempt(self, batch_size: int, steps: int, most: int, prepare: Callable[[], object] | None) -> str | None:
        """Run the steps (up to ``most`` while the allocator settles); None on success, else the OOM's
        first line (or, where the step caught errors itself, :func:`~autobatch.probe.caught.caught_error`); leaves
        the ``except`` block before anything is freed. ``prepare``: ``layout``."""
        if self.before_trial is not None:  # no mask a larger trial's forward kept is held through this one
            self.before_trial()
        release_workspaces(self._fresh_workspaces)  # each trial starts as a new process's first step
        self.memory.release_cached()
        if prepare is not None:
            prepare()
        self._baseline, self._growth = self.memory.allocated(), self.held_growth()
        self._peak = self._reserved = 0
        self._step_peak = self._step_reserved = self._resident = self._fragmentation = self._inactive_split = None
        self._steps_run = 0
        self._failed_at = self._reserved_at_failure = None
        self._stopped = False
        self._flush_count = FlushCount()
        self._started = time.perf_counter()
        step_reserved: list[int] = []
        self._caught = CaughtWatch(self.memory)  # out-of-memory errors the step catches itself (caught.py)
        try:
            with self.guard if self.guard is not None else nullcontext():
                self._steps(batch_size, steps, most, step_reserved)
            self.memory.synchronize()
            self._inactive_split = split_bytes(self.memory)
        except BaseException as exc:  # noqa: BLE001 - re-raised below unless it is an OOM
            if raised_by_guard(exc):
                self._stopped = True  # its peak, folded in, is above the limit: the trial fails as too close
                return None
            if not is_oom_error(exc):
                raise with_trial_note(exc, batch_size, self.passed_sizes, failed=self.failed_sizes, placed=self.first_placed)
            self._failed_at = self.memory.allocated()  # the failed step's tensors are still held here
            # the step's reserved peak: by now the allocator has returned its cache (it does so
            # before it gives up), so the reserved figure of this moment no longer shows the wall
            self._reserved_at_failure = self.memory.peak_reserved()
            return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        count = self._caught.caught()
        return caught_error(count, batch_size, self.fn) if count else None

    def _steps(self, batch_size: int, steps: int, most: int, step_reserved: list[int]) -> None:
        """Call ``fn`` ``steps`` times (up to ``most`` while the reserved peak grows or the last
        step flushed the allocator's cache), reading each step's peaks and the allocator's
        retry counter; stop once a step's peak passed the peak limit."""
        retries = getattr(self.memory, "alloc_retries", lambda: None)
        self._flush_count.read(retries())
        # the extra settling steps are agreed (settle_more): ranks in lockstep make the same calls
        while self._steps_run < steps or (
            self._steps_run < most
            and self.settle_more(growing(step_reserved) or self._flushes_matter() and self._flush_count.flushing)
        ):
            self.memory.reset_peak()
            self._resident = self.memory.allocated()
            self._steps_run += 1
            try:
                self.fn(batch_size)
            finally:
                self._fold_peaks()
            self._caught.step_done()
            step_reserved.append(self._step_reserved)
            self._flush_count.read(retries())
            if self.agree is None and self.peak_limit is not None and self._peak > self.peak_limit:
                # too close already: more steps cannot make it pass. Not under agreement:
                # ranks in lockstep make the same calls, and each step enters collectives
                break

    def _flushes_matter(self) -> str | None:
        """Why a settle trial keeps stepping while its steps flush the allocator's cache (up to
        :func:`~autobatch.probe.settling.most_steps`: flushing at the wall comes and goes) and
        fails if its last still does, as a key of ``settling.FLUSHING_WHY``: the segments are
        expandable, cuDNN autotuning is wanted, a hand loop trains the answer (it cannot replay a
        step, and a resumed run failed at a flushing size), or the Runner does (ResNet-101's 120
        flushed in every step and ran out of memory at its steps 2-5 in every process)."""
        if self.expandable:
            return "expandable"
        if self.autotune is not None and self.autotune.wanted:
            return "autotuned"
        return "hand_loop" if self.hand_loop else "replay"

    def _wall_excess(self) -> int:
        """Bytes by which the trial's steady step left no room for the split pieces the allocator
        cannot return (:func:`~autobatch.probe.settling.wall_excess`); 0 off accelerators or after
        one step (the first autotunes and creates the optimizer's state). The last step's reserved
        peak bounds it as :func:`~autobatch.probe.settling.reserved_bound` says."""
        if self.peak_limit is None or self._inactive_split is None or self._steps_run < 2:
            return 0
        capacity, count = self.memory.capacity(), self._flush_count
        reserved, margin = reserved_bound(self._step_reserved, count.flushes, count.flushing, self.expandable,
                                          capacity - self.peak_limit)
        return wall_excess(self._step_peak, self._inactive_split, capacity, reserved, margin=margin)

    def _fold_peaks(self) -> None:
        """The trial's peaks are the largest of its steps' (each step starts a fresh peak)."""
        self._step_peak = self.memory.peak()
        self._peak = max(self._peak, self._step_peak)
        self._step_reserved = self.memory.peak_reserved()
        self._reserved = max(self._reserved, self._step_reserved)
        self._fragmentation = max(0, self._step_reserved - self._step_peak)

    def peak_of(self, batch_size: int) -> int | None:
        """Allocated peak of the latest passing trial's last step at ``batch_size`` (None if
        none passed): the steady step. Allocated memory grows smoothly with the batch; reserved
        memory adds the allocator's rounding, which at small batches dwarfs the activations."""
        record = self.passed_record(batch_size)
        return None if record is None else record.step_peak_bytes

    def passed_record(self, batch_size: int) -> TrialRecord | None:
        """The latest passing trial at ``batch_size`` (None if none passed)."""
        return next((r for r in reversed(self.records) if r.batch_size == batch_size and r.passed), None)

    @property
    def passed_sizes(self) -> list[int]:
        return sorted(b for b, ok in self.outcomes.items() if ok)

    @property
    def failed_sizes(self) -> list[int]:
        return sorted(b for b, ok in self.outcomes.items() if not ok)
