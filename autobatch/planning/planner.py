"""plan(): keep the user's global batch, and find how to run it on this device.

The global batch is what the learning rate and convergence depend on, so the planner never
changes it: when it does not fit in one step it is split into micro-batches whose gradients
are accumulated (:mod:`autobatch.planning.accumulation`); when not even batch 1 fits, the model's
repeated blocks are checkpointed (:mod:`autobatch.planning.checkpointing`) and the probe runs again.

Objectives:

* ``max_batch`` (default): the largest micro-batch that trains. The global batch in one step when it
  fits; otherwise ``accumulation_steps = ceil(global / largest fitting)`` and the micro-batches balanced
  (sizes differ by at most one, the micro-batch is ``ceil(global / accumulation_steps)``), so no step is
  mostly empty. Checkpointing is turned on only when batch 1 does not fit, or when accumulation is not
  allowed and checkpointing lets the whole global batch fit.
* ``throughput``: time candidate plans (:mod:`autobatch.planning.throughput`) and pick the one with
  the most samples/s: micro-batches from small to the largest that fits, without
  checkpointing and, where checkpointing makes larger micro-batches fit, with it. A
  checkpointed candidate is only timed at sizes the plain model cannot run: at equal size it
  does the same work plus a recomputed forward (``exhaustive=True`` times them anyway).
  Every candidate is timed once (warm-up, then ``timed_steps`` steps; the median step
  counts); the leaders, those within ``retime_within`` of the best, are then re-timed in
  ``retime_rounds`` interleaved rounds, and the pooled median picks the winner (the fastest
  step of one short pass can be a lucky one, and drift can favour whoever ran at a good time).

With ``multiple_of`` > 1 every micro-batch is a multiple of it (full pieces of the least-padded
multiple, a smaller last one); a global batch that is not one cannot be split so: one step (the
probes try it alone) or a ``ValueError``. A plan that uses checkpointing leaves the model *wrapped*
(``Plan.checkpointing`` says so; ``Plan.undo()`` unwraps it); otherwise it is left as given.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from ..errors import GlobalBatchTooLargeError, NoBatchFitsError, add_note
from ..memory.oom import free_memory
from ..probe.arguments import compiled_plan_notes, eval_mode_notes
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from ..probe.train_step import TrainStep
from .accumulation import micro_batch_sizes
from .batch_statistics import batch_norm_layers, batch_statistics_note, power_iteration_note
from .checkpointing import (CheckpointHandle, enable_checkpointing, find_blocks, no_blocks_hint, put_back_checkpointing,
                            take_checkpointing)
from .fastest import ThroughputObjective
from .module_names import unregistered_notes
from .own_checkpointing import CacheWatch, cache_note
from .plan_errors import PlanErrors
from .plan_arguments import OBJECTIVES, ragged_message, smallest_batch, validate, validate_timing
from .plan_result import Plan, candidates_table, short_list, sizes_text
from .sparse_accumulation import accumulating_step
from .split_checks import check_batch_first, loss_split_note
from .throughput import balanced_micro_batch

__all__ = ["Plan", "plan", "OBJECTIVES", "candidates_table"]

log = logging.getLogger("autobatch")


def plan(
    step: TrainStep,
    *,
    global_batch: int,
    objective: str = "max_batch",
    allow_accumulation: bool = True,
    allow_checkpointing: bool = True,
    checkpoint_targets: list[str] | None = None,
    balanced: bool = True,
    min_micro_batch: int | None = None,
    exhaustive: bool = False,
    warmup_steps: int = 1,
    timed_steps: int = 5,
    retime_rounds: int = 2,
    retime_within: float = 0.1,
    timer: Callable[[], float] = time.perf_counter,
    allocator_retries: Callable[[], int | None] | None = None,
    **probe_kwargs: Any,
) -> Plan:
    """Find the best way to train ``global_batch`` samples per optimizer step with ``step``.

    Args:
        step: the :class:`~autobatch.TrainStep`; ``make_batch(B)`` builds (micro-)batches.
        global_batch: samples per optimizer step; kept exactly.
        objective: ``"max_batch"`` (largest micro-batch) or ``"throughput"`` (most samples/s).
        allow_accumulation: may split the global batch into micro-batches.
        allow_checkpointing: may wrap repeated blocks with activation checkpointing.
        checkpoint_targets: class names or classes of the blocks to checkpoint, or the blocks
            themselves (``model.layers``) (default: children of ``nn.Sequential`` / entries of
            ``nn.ModuleList`` or ``nn.ModuleDict`` that repeat).
        balanced: balanced micro-batches (sizes differ by at most one) rather than full ones
            and a smaller last one; off when ``multiple_of`` > 1 (sizes stay multiples).
        min_micro_batch: throughput: the smallest micro-batch timed (default: largest // 16).
        exhaustive: throughput: also time checkpointed candidates the plain model can run
            (probing with checkpointing even when the global batch fits without it).
        warmup_steps: throughput: untimed global steps before each candidate's timed ones
            (in every round), so one-off costs (autotuning, cache growth) are not timed.
        timed_steps: throughput: global steps timed one by one per candidate and round; the
            candidate's speed is the global batch over the median step time.
        retime_rounds: throughput: interleaved rounds (A B C A B C ...) in which the leading
            candidates are timed again after the first pass; the pick is by the median of all
            their timed steps (0: no re-timing).
        retime_within: throughput: which candidates lead: those within this fraction of the
            best first-pass samples/s (0.1: within 10 %); re-timing needs two or more.
        timer: throughput: the clock (seconds); injectable for tests.
        allocator_retries: throughput: the allocator's cumulative retry count (default: the
            accelerator's ``num_alloc_retries``; none on the CPU); injectable for tests.
            Candidates whose timed steps saw retries are flagged in the table.
        **probe_kwargs: passed to :func:`~autobatch.find_max_batch` (``strategy``,
            ``memory_limit``, ``steps_per_trial``, ``multiple_of``, ...); ``max_batch`` caps
            the micro-batch (default ``global_batch``), ``start`` is at most ``global_batch``;
            ``margin`` is taken once, off the micro-batch (none off a global batch that fits).

    Raises:
        ValueError: a bad argument, or a global batch not a multiple of ``multiple_of`` that
            does not fit in one step.
        NoBatchFitsError: batch 1 does not fit even with checkpointing (or checkpointing is
            not allowed, or found nothing to wrap); the message gives both attempts' figures.
        GlobalBatchTooLargeError: the global batch does not fit in one step and accumulation
            is not allowed.
    """
    global_batch, min_micro_batch = validate(
        step, global_batch, objective, probe_kwargs, min_micro_batch, allow_accumulation=allow_accumulation,
        allow_checkpointing=allow_checkpointing, balanced=balanced, exhaustive=exhaustive,
    )
    if checkpoint_targets is not None:
        find_blocks(step.model, checkpoint_targets)  # targets that match nothing: a ValueError now, not a wrong plan
    timing = validate_timing(warmup_steps=warmup_steps, timed_steps=timed_steps, retime_rounds=retime_rounds,
                             retime_within=retime_within, timer=timer, allocator_retries=allocator_retries)
    if allow_accumulation:
        check_batch_first(step)  # a sequence-first batch: every split would cut its time steps
    cap = min(global_batch, probe_kwargs.pop("max_batch", None) or global_batch)
    multiple_of = probe_kwargs.get("multiple_of", 1)
    if balanced and isinstance(multiple_of, int) and multiple_of > 1:
        balanced = False  # balanced sizes would not be multiples; full chunks and a smaller last one
    ragged = isinstance(multiple_of, int) and multiple_of > 1 and global_batch % multiple_of != 0
    planner = _Planner(step, global_batch, cap, checkpoint_targets, probe_kwargs, allow_checkpointing)
    planner.notes.extend(eval_mode_notes(step) + compiled_plan_notes(step, probe_kwargs.get("hand_loop")) + unregistered_notes(step.model))
    # blocks a plan (or anyone with enable_checkpointing) left wrapped: plan from the plain model,
    # and leave them as given unless the new plan wraps the model itself
    given = take_checkpointing(step.model)  # the same forwards go back: their plan's undo() still owns them
    try:
        if ragged:  # its micro-batches cannot all be multiples: one step, or no plan
            result = planner.one_step(allow_checkpointing, objective)
        elif objective == "max_batch":
            result = planner.largest(allow_accumulation, allow_checkpointing, balanced)
        else:
            result = planner.fastest(
                allow_accumulation, allow_checkpointing, balanced, min_micro_batch=min_micro_batch,
                exhaustive=exhaustive, timing=timing, timer=timer, allocator_retries=allocator_retries,
            )
    except BaseException:
        planner.unwrap()
        put_back_checkpointing(step.model, given)
        raise
    if not result.checkpointing and given:
        put_back_checkpointing(step.model, given)
    log.info("plan: global %d in micro-batches of %s, checkpointing %s (%s)", result.global_batch, sizes_text(result.micro_batch_sizes),
             "on" if result.checkpointing else "off", result.reason)
    return result


class _Planner(PlanErrors, ThroughputObjective):
    """The state of one plan() call: probes run so far and the checkpoint handle."""

    def __init__(self, step, global_batch, cap, targets, probe_kwargs, allow_checkpointing: bool = True) -> None:
        self.step = step
        self.global_batch = global_batch
        self.cap = cap
        self.targets = targets
        self.probe_kwargs = probe_kwargs
        self.allow_checkpointing = allow_checkpointing
        self.probes: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.handle: CheckpointHandle | None = None
        self.cache = CacheWatch()  # what the checkpointed forwards handed back: a key/value cache, or none

    # -- probing --------------------------------------------------------------------------
    def probe(self, checkpointing: bool, *, accumulating: int | None = None,
              only: int | None = None) -> tuple[ProbeResult | None, NoBatchFitsError | None]:
        """Probe the largest batch up to the cap in the model's current wrapping; with
        ``accumulating`` (a one-step answer), the largest micro-batch of an accumulated step
        up to it (:func:`~autobatch.planning.sparse_accumulation.accumulating_step`); with ``only``,
        that size alone (in units of itself: the search tries nothing else), in at least two
        steps: its trial is also the first, whose first step creates the optimizer's state.
        Those two take no margin (the planner takes it once, :meth:`with_margin`), and a
        ``start`` above their cap starts at it (the probe refused it, naming a ``max_batch``)."""
        step = self.step if accumulating is None else accumulating_step(self.step, self.global_batch)
        cap = only or accumulating or self.cap
        options = self.probe_kwargs
        if accumulating is not None or only is not None:
            start = options.get("start")
            options = {**options, "margin": 0.0, "start": None if start is None else min(start, cap)}
        if only is not None:
            steps = max(2, options.get("steps_per_trial", 3))
            options = {**options, "multiple_of": only, "start": only, "steps_per_trial": steps}
        try:
            result = find_max_batch(step, max_batch=cap, **options)
        except NoBatchFitsError as exc:
            error = exc
        else:
            self.probes.append({"checkpointing": checkpointing, "accumulating": accumulating is not None, "fits": True,
                                "result": result.to_dict()})
            return result, None
        free_memory()
        self.probes.append({
            "checkpointing": checkpointing, "accumulating": accumulating is not None, "fits": False, "result": None,
            "batch_size": error.batch_size, "peak_bytes": error.peak_bytes, "capacity_bytes": error.capacity_bytes,
            "device": error.device, "error": str(error),
        })  # fmt: skip
        return None, error

    def wrap(self) -> bool:
        """Turn checkpointing on; False (with a note, once) when there is nothing to wrap, or the
        model checkpoints its blocks itself (wrapping them again nested a recompute in theirs; :meth:`own`)."""
        own = self.own()
        if not own and (self.handle is None or not self.handle.active):
            self.handle = enable_checkpointing(self.step.model, self.targets)
        if own or not self.handle.modules:
            self.note(f"activation checkpointing wrapped no block: {no_blocks_hint(self.step.model, self.targets, self.recomputed)}")
            return False
        return True

    def note(self, note: str | None) -> None:
        """Add ``note`` to the plan's notes, once (each wrap of a plan's probes would repeat it)."""
        if note is not None and note not in self.notes:  # a fuller note replaces one it holds (unregistered_notes)
            self.notes[:] = [old for old in self.notes if old not in note] + [note]

    def unwrap(self) -> None:
        if self.handle is not None:
            self.handle.undo()

    def probe_checkpointed(self, *, accumulating: int | None = None, only: int | None = None) -> tuple[ProbeResult | None, NoBatchFitsError | None]:
        if not self.wrap():
            return None, None
        try:
            with self.cache.watching(self.step.model):
                result, error = self.probe(True, accumulating=accumulating, only=only)
        except RuntimeError as exc:  # CheckpointError (a recompute unlike the forward), or an in-place write: no OOM figure
            self.recompute_note(exc)
            raise
        self.note(cache_note(self.step.model, self.cache))
        self.unwrap()
        return result, error

    def fits(self, one_step: ProbeResult) -> bool:
        """Whether the global batch trains in one step: the probe's boundary before its margin
        (``largest_passed``) reached it, and no trial at it failed (a hand loop's fresh-layout
        trial can, after it passed). The global batch is then the cap and no OOM was seen below
        it, so no margin is taken off it: that would split a batch that fits with room to spare."""
        reached = (one_step.largest_passed or one_step.batch_size) >= self.global_batch
        return reached and all(t.passed for t in one_step.trials if t.batch_size >= self.global_batch)

    def accumulated(self, one_step: ProbeResult, checkpointing: bool) -> int:
        """The largest micro-batch an accumulated step trains, up to the one-step boundary
        (``largest_passed``, before the margin), less the margin, taken once (:meth:`with_margin`).
        A plan with accumulation holds the first micro-batch's gradients through the next one's
        step, which the one-step trials never held; when not even micro-batch 1 fits beside them,
        the accumulated probe's ``NoBatchFitsError``, with every attempt's figures."""
        boundary = one_step.largest_passed or one_step.batch_size
        if checkpointing:
            result, error = self.probe_checkpointed(accumulating=boundary)
        else:
            result, error = self.probe(False, accumulating=boundary)
        if result is not None:
            return self.with_margin(result, one_step, checkpointing)
        raise self._attempts_error(error, self.accumulation_hint(boundary, checkpointing))

    def with_margin(self, accumulated: ProbeResult, one_step: ProbeResult, checkpointing: bool) -> int:
        """The accumulated probe's answer (run without a margin) less the user's ``margin``,
        rounded down to ``multiple_of``: the margin taken once, off the boundary the plan rests
        on. None is taken where neither probe met a memory boundary (both answered their cap: a
        ``max_batch`` below the global batch, and no OOM seen), as none is off the global batch."""
        margin, size = self.probe_kwargs.get("margin") or 0.0, accumulated.batch_size
        if not margin or (accumulated.hit_max_batch and one_step.hit_max_batch):
            return size
        multiple_of = self.probe_kwargs.get("multiple_of", 1)
        reduced = max(multiple_of, math.floor(size * (1 - margin)) // multiple_of * multiple_of)
        if reduced < size:
            self.notes.append(f"margin {margin:.0%} taken once, off the largest micro-batch an accumulated step trains "
                              f"{'with' if checkpointing else 'without'} activation checkpointing ({size}): at most {reduced}")
        return reduced

    def one_step(self, allow_checkpointing: bool, objective: str) -> Plan:
        """A global batch that is not a multiple of ``multiple_of``: split, its micro-batches
        could not all be multiples (100 by 8 gave 96 + 4, and 65 gave 64 + 1, which BatchNorm
        cannot train), so it runs in one step, plainly or with checkpointing, or there is no
        plan. The probes try the global batch itself, the only size that matters."""
        size, multiple_of = self.global_batch, self.probe_kwargs["multiple_of"]
        self.notes.append(f"global_batch={size} is not a multiple of multiple_of={multiple_of}: it is not split, "
                          "and the probes tried it alone, in one step")
        plain, plain_error = self.probe(False, only=size)
        if plain is not None:
            return self.build(size, False, objective, "the global batch fits in one step", False)
        ckpt = self.probe_checkpointed(only=size)[0] if allow_checkpointing else None
        if ckpt is not None:
            why = "the global batch fits in one step only with activation checkpointing"
            return self.build(size, True, objective, why, False)
        tried = " even with activation checkpointing" if allow_checkpointing and self.handle is not None and self.handle.modules else ""
        why = f"it does not fit in one step{tried}{self.failed_peak(plain_error, bool(tried))}"
        raise ValueError(ragged_message(size, multiple_of, why))

    # -- objective: max_batch -------------------------------------------------------------------
    def largest(self, allow_accumulation: bool, allow_checkpointing: bool, balanced: bool) -> Plan:
        plain, plain_error = self.probe(False)
        if plain is not None and self.fits(plain):
            return self.build(self.global_batch, False, "max_batch", "the global batch fits in one step", balanced)
        accumulation_error = None  # micro-batch 1 fits alone, not beside the first one's gradients
        if plain is not None and allow_accumulation:
            try:
                accumulated = self.accumulated(plain, False)
            except NoBatchFitsError as exc:
                if not allow_checkpointing:
                    raise
                accumulation_error = exc  # checkpointing is tried
            else:
                why = f"largest micro-batch that fits with accumulation is {accumulated} ({plain.largest_passed or plain.batch_size} in one step)"
                return self.build(accumulated, False, "max_batch", why, balanced)
        if not allow_checkpointing:
            if plain is None:
                raise self.no_fit(plain_error, None, False)
            raise GlobalBatchTooLargeError(self.global_batch, plain.batch_size, False, plain.device)
        ckpt, ckpt_error = self.probe_checkpointed()
        if ckpt is None:
            if plain is None:
                raise self.no_fit(plain_error, ckpt_error, True)
            why = self.no_block_why() if ckpt_error is None else f"with it, not even {smallest_batch(self.probe_kwargs)} fit"
            if accumulation_error is not None:  # its hint named no checkpointing, as if none had been tried
                raise self._attempts_error(accumulation_error, self.accumulation_hint(plain.largest_passed or plain.batch_size, False, why))
            raise GlobalBatchTooLargeError(self.global_batch, plain.batch_size, False, plain.device, why)
        if self.fits(ckpt):
            why = "the global batch fits in one step only with activation checkpointing"
            return self.build(self.global_batch, True, "max_batch", why, balanced)
        if not allow_accumulation:  # checkpointing can cost memory (a gradient penalty's double backward): say so
            best = plain if plain is not None and plain.batch_size >= ckpt.batch_size else None
            raise GlobalBatchTooLargeError(self.global_batch, (best or ckpt).batch_size, best is None, ckpt.device,
                                           None if best is None else f"with it, the largest is {ckpt.batch_size}")
        accumulated = self.accumulated(ckpt, True)
        what = smallest_batch(self.probe_kwargs) if plain is None else "an accumulated micro-batch"
        why = (f"{what} does not fit without activation checkpointing; with it, up to {accumulated} fits "
               f"with accumulation ({ckpt.largest_passed or ckpt.batch_size} in one step)")
        return self.build(accumulated, True, "max_batch", why, balanced)

    def check_one_sample(self, sizes: list[int], largest: int, checkpointing: bool, balanced: bool) -> None:
        """A split with a micro-batch of one sample, for a model with BatchNorm in training: one trial
        at batch 1 (checkpointed as planned), which the probes, stopping above it, never ran. A model
        that cannot train on one sample ("Expected more than 1 value per channel") then fails here,
        with what to change, not in training (global batch 9 with 2 fitting was planned 2, 2, 2, 2, 1)."""
        try:
            if checkpointing:
                self.probe_checkpointed(only=1)
            else:
                self.probe(False, only=1)
        except Exception as exc:
            size = self.global_batch
            other = micro_batch_sizes(size, largest, balanced=True)
            fix = (f"balanced=True (micro-batches {short_list(other)})" if not balanced and min(other) > 1 else
                   f"an even global batch ({size - 1} or {size + 1}) with multiple_of=2, or more memory")
            add_note(exc, f"autobatch: plan() split global_batch={size} into {len(sizes)} micro-batches of at most {largest} "
                          f"(what fits), the last of a single sample, and this error came from a trial at 1: the model "
                          f"cannot train on one sample. Use {fix}.")
            raise

    def build(self, largest: int, checkpointing: bool, objective: str, reason: str, balanced: bool, **extra) -> Plan:
        """A plan for micro-batches of at most ``largest``; wraps the model when needed."""
        multiple = self.probe_kwargs.get("multiple_of", 1)  # > 1: full pieces of the least-padded multiple
        micro = balanced_micro_batch(self.global_batch, largest, multiple) if balanced or multiple > 1 else min(largest, self.global_batch)
        sizes = micro_batch_sizes(self.global_batch, micro, balanced=balanced)
        if objective == "max_batch" and len(sizes) > 1 and min(sizes) == 1 and batch_norm_layers(self.step.model):
            self.check_one_sample(sizes, largest, checkpointing, balanced)
        if checkpointing:
            self.wrap()
        else:
            self.unwrap()
        piece = self.probe_kwargs.get("multiple_of", 1)  # accumulation is exact but for these: say so where a split meets them
        for note in (batch_statistics_note(self.step.model, sizes), power_iteration_note(self.step.model, sizes),
                     loss_split_note(self.step, sizes, piece)):
            if note is not None:
                log.warning("plan: %s", note)
                self.notes.append(note)
        return Plan(
            global_batch=self.global_batch,
            micro_batch=max(sizes),
            accumulation_steps=len(sizes),
            micro_batch_sizes=sizes,
            checkpointing=checkpointing,
            checkpointed_modules=list(self.handle.modules) if checkpointing else [],
            balanced=balanced,
            objective=objective,
            reason=reason,
            probes=self.probes,
            notes=self.notes,
            handle=self.handle if checkpointing else None,
            **extra,
        )
