"""plan(): keep the user's global batch, and find how to run it on this device.

The global batch is what the learning rate and convergence depend on, so the planner never
changes it: when it does not fit in one step it is split into micro-batches whose gradients
are accumulated (:mod:`autobatch.planning.accumulation`); when not even batch 1 fits, the model's
repeated blocks are checkpointed (:mod:`autobatch.planning.checkpointing`) and the probe runs again.

Objectives:

* ``max_batch`` (default): the largest micro-batch that trains. The global batch in one
  step when it fits; otherwise ``accumulation_steps = ceil(global / largest fitting)`` and the
  micro-batches balanced (sizes differ by at most one, the micro-batch is
  ``ceil(global / accumulation_steps)``), so no step is mostly empty. Checkpointing is turned
  on only when batch 1 does not fit, or when accumulation is not allowed and checkpointing
  lets the whole global batch fit.
* ``throughput``: time candidate plans (:mod:`autobatch.planning.throughput`) and pick the one with
  the most samples/s: micro-batches from small to the largest that fits, without
  checkpointing and, where checkpointing makes larger micro-batches fit, with it. A
  checkpointed candidate is only timed at sizes the plain model cannot run: at equal size it
  does the same work plus a recomputed forward (``exhaustive=True`` times them anyway).
  Every candidate is timed once (warm-up, then ``timed_steps`` steps; the median step
  counts); the leaders, those within ``retime_within`` of the best, are then re-timed in
  ``retime_rounds`` interleaved rounds, and the pooled median picks the winner (the fastest
  step of one short pass can be a lucky one, and drift can favour whoever ran at a good time).

With ``multiple_of`` > 1 every micro-batch is a multiple of it; a global batch that is not
one cannot be split so, and runs in one step (the probes try it alone) or is a ``ValueError``.
When the plan uses checkpointing the model *stays wrapped* (``Plan.checkpointing`` says so;
``Plan.undo()`` unwraps it); otherwise the model is left as it was given.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..errors import GlobalBatchTooLargeError, NoBatchFitsError
from ..memory.oom import free_memory
from ..memory.units import format_bytes
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from ..probe.train_step import TrainStep
from .accumulation import AccumulatingStep, micro_batch_sizes
from .checkpointing import CheckpointHandle, enable_checkpointing, find_blocks, is_checkpointed
from .fastest import ThroughputObjective
from .plan_result import Plan, candidates_table, short_list
from .throughput import balanced_micro_batch, validate_timing

__all__ = ["Plan", "plan", "OBJECTIVES", "candidates_table"]

log = logging.getLogger("autobatch")

OBJECTIVES = ("max_batch", "throughput")


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
        checkpoint_targets: class names of the blocks to checkpoint (default: children of
            ``nn.Sequential`` / entries of ``nn.ModuleList`` that repeat).
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
            ``memory_limit``, ``steps_per_trial``, ``margin``, ``multiple_of``, ...);
            ``max_batch`` caps the micro-batch (default ``global_batch``).

    Raises:
        ValueError: a bad argument, or a global batch not a multiple of ``multiple_of`` that
            does not fit in one step.
        NoBatchFitsError: batch 1 does not fit even with checkpointing (or checkpointing is
            not allowed, or found nothing to wrap); the message gives both attempts' figures.
        GlobalBatchTooLargeError: the global batch does not fit in one step and accumulation
            is not allowed.
    """
    _validate(step, global_batch, objective, probe_kwargs, min_micro_batch)
    _check_one_step_cap(global_batch, probe_kwargs.get("max_batch"), allow_accumulation)
    if checkpoint_targets is not None:
        find_blocks(step.model, checkpoint_targets)  # targets that match nothing: a ValueError now, not a wrong plan
    timing = dict(
        warmup_steps=warmup_steps, timed_steps=timed_steps, retime_rounds=retime_rounds, retime_within=retime_within
    )
    validate_timing(**timing)
    cap = min(global_batch, probe_kwargs.pop("max_batch", None) or global_batch)
    multiple_of = probe_kwargs.get("multiple_of", 1)
    if balanced and isinstance(multiple_of, int) and multiple_of > 1:
        balanced = False  # balanced sizes would not be multiples; full chunks and a smaller last one
    ragged = isinstance(multiple_of, int) and multiple_of > 1 and global_batch % multiple_of != 0
    planner = _Planner(step, global_batch, cap, checkpoint_targets, probe_kwargs)
    # blocks a plan (or anyone with enable_checkpointing) left wrapped: plan from the plain model,
    # and leave them as given unless the new plan wraps the model itself
    given = [name for name, module in step.model.named_modules() if is_checkpointed(module)]
    CheckpointHandle(step.model, given).undo()
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
        enable_checkpointing(step.model, modules=given)
        raise
    if not result.checkpointing and given:
        enable_checkpointing(step.model, modules=given)
    log.info("plan: global %d = %d x %d micro-batches, checkpointing %s (%s)", result.global_batch, result.micro_batch,
             result.accumulation_steps, "on" if result.checkpointing else "off", result.reason)
    return result


def _validate(step, global_batch, objective, probe_kwargs, min_micro_batch=None) -> None:
    missing = [name for name in ("model", "optimizer", "loss_fn", "make_batch") if not hasattr(step, name)]
    if missing:
        raise TypeError(f"step must be an autobatch.TrainStep (it lacks {', '.join(missing)}), got {step!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch <= 0:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    max_batch, multiple_of = probe_kwargs.get("max_batch"), probe_kwargs.get("multiple_of", 1)
    if not isinstance(max_batch, (int, type(None))) or isinstance(max_batch, bool) or (max_batch is not None and max_batch < 1):
        raise ValueError(f"max_batch must be a positive integer or None, got {max_batch!r}")
    if min_micro_batch is not None and (type(min_micro_batch) is not int or min_micro_batch < 1):
        raise ValueError(f"min_micro_batch must be a positive integer or None (throughput: the smallest micro-batch "
                         f"timed), got {min_micro_batch!r}")
    if isinstance(multiple_of, int) and not isinstance(multiple_of, bool) and multiple_of > global_batch:
        raise ValueError(f"global_batch={global_batch} is smaller than multiple_of={multiple_of}: no micro-batch of it "
                         "is a multiple; lower multiple_of or raise global_batch")
    if isinstance(multiple_of, int) and multiple_of > 1 and global_batch % multiple_of and (max_batch or global_batch) < global_batch:
        raise ValueError(_ragged_message(global_batch, multiple_of, f"max_batch={max_batch} keeps it from one step"))


def _ragged_message(global_batch: int, multiple_of: int, why: str) -> str:
    """The error for a global batch that is not a multiple of ``multiple_of`` and cannot run in one step."""
    below = global_batch // multiple_of * multiple_of
    return (f"global_batch={global_batch} is not a multiple of multiple_of={multiple_of}, so its micro-batches cannot "
            f"all be multiples, and {why}; use a global_batch that is a multiple of {multiple_of} "
            f"({below} or {below + multiple_of}), or a multiple_of that divides {global_batch}")


def _check_one_step_cap(global_batch: int, max_batch: int | None, allow_accumulation: bool) -> None:
    """Without accumulation one step holds the global batch: a ``max_batch`` below it can never plan."""
    if not allow_accumulation and max_batch is not None and max_batch < global_batch:
        raise ValueError(f"max_batch={max_batch} is below global_batch={global_batch} and allow_accumulation=False: "
                         "one step must hold the whole global batch; raise max_batch or allow accumulation")


class _Planner(ThroughputObjective):
    """The state of one plan() call: probes run so far and the checkpoint handle."""

    def __init__(self, step, global_batch, cap, targets, probe_kwargs) -> None:
        self.step = step
        self.global_batch = global_batch
        self.cap = cap
        self.targets = targets
        self.probe_kwargs = probe_kwargs
        self.probes: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.handle: CheckpointHandle | None = None

    # -- probing --------------------------------------------------------------------------
    def probe(self, checkpointing: bool, *, accumulating: int | None = None,
              only: int | None = None) -> tuple[ProbeResult | None, NoBatchFitsError | None]:
        """Probe the largest batch up to the cap in the model's current wrapping; with
        ``accumulating`` (a one-step answer), the largest micro-batch of an accumulated step
        up to it (:class:`~autobatch.planning.accumulation.AccumulatingStep`); with ``only``,
        that size alone (in units of itself: the search tries nothing else), in at least two
        steps: its trial is also the first, whose first step creates the optimizer's state."""
        step = self.step if accumulating is None else AccumulatingStep(self.step)
        options = self.probe_kwargs
        if only is not None:
            steps = max(2, options.get("steps_per_trial", 3))
            options = {**options, "multiple_of": only, "start": only, "steps_per_trial": steps}
        try:
            result = find_max_batch(step, max_batch=only or accumulating or self.cap, **options)
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
        """Turn checkpointing on; False (with a note) when there is nothing to wrap."""
        if self.handle is None or not self.handle.active:
            self.handle = enable_checkpointing(self.step.model, self.targets)
        if not self.handle.modules:
            self.notes.append(
                "activation checkpointing found no repeated blocks to wrap (no nn.Sequential / nn.ModuleList with "
                "repeated children; a single torch.nn layer is no block); name the block classes in checkpoint_targets"
            )
            return False
        return True

    def unwrap(self) -> None:
        if self.handle is not None:
            self.handle.undo()

    def probe_checkpointed(self, *, accumulating: int | None = None, only: int | None = None) -> tuple[ProbeResult | None, NoBatchFitsError | None]:
        if not self.wrap():
            return None, None
        result, error = self.probe(True, accumulating=accumulating, only=only)
        self.unwrap()
        return result, error

    def accumulated(self, one_step: ProbeResult, checkpointing: bool) -> ProbeResult:
        """The largest micro-batch an accumulated step trains, up to the one-step answer. A plan
        with accumulation holds the first micro-batch's gradients through the next one's step,
        which the one-step trials never held; when not even micro-batch 1 fits beside them, the
        accumulated probe's ``NoBatchFitsError``, with every attempt's figures."""
        if checkpointing:
            result, error = self.probe_checkpointed(accumulating=one_step.batch_size)
        else:
            result, error = self.probe(False, accumulating=one_step.batch_size)
        if result is not None:
            return result
        raise self._attempts_error(
            error,
            f"up to {one_step.batch_size} fits in one step, but not the global batch; with accumulation the first "
            "micro-batch's gradients stay alive through the next one's step and no micro-batch fits beside them. "
            f"Try {self._other_options()}.",
        )

    def no_fit(self, plain_error: NoBatchFitsError, checkpoint_error: NoBatchFitsError | None, allowed: bool):
        """The NoBatchFitsError for "not even batch 1", with both attempts' figures."""
        if not allowed:
            return plain_error
        if checkpoint_error is None:  # nothing to wrap
            return self._attempts_error(
                plain_error,
                "Activation checkpointing was tried but found no repeated blocks to wrap; name the "
                f"block classes in checkpoint_targets, or try {self._other_options()}.",
            )
        modules = self.handle.modules if self.handle is not None else []
        return self._attempts_error(
            checkpoint_error,
            f"This is with activation checkpointing of {len(modules)} blocks "
            f"({short_list(modules)}); without it batch {plain_error.batch_size} peaked at "
            f"{format_bytes(plain_error.peak_bytes)} before failing. Try {self._other_options()}.",
        )

    def _other_options(self) -> str:
        """What is left to try when nothing fits: lower precision only where the step is not
        already under fp16/bf16 autocast."""
        precision = "" if self.step.autocast_dtype is not None else "lower precision (bf16/fp16 autocast), "
        return f"{precision}a smaller model or sequence length, an optimizer with less state, or a larger memory_limit / device"

    def _attempts_error(self, source: NoBatchFitsError, hint: str) -> NoBatchFitsError:
        """``source``'s figures with a new hint, carrying every probe attempt in ``attempts``."""
        error = NoBatchFitsError(
            batch_size=source.batch_size,
            capacity_bytes=source.capacity_bytes,
            peak_bytes=source.peak_bytes,
            device=source.device,
            last_error=source.last_error,
            hint=hint,
            diagnostics=source.diagnostics,
        )
        error.attempts = self.probes
        return error

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
        wrapped = allow_checkpointing and self.handle is not None and self.handle.modules
        tried = " even with activation checkpointing" if wrapped else ""
        peak = f" (plainly it peaked at {format_bytes(plain_error.peak_bytes)})" if plain_error.peak_bytes else ""
        why = f"it does not fit in one step{tried}{peak}"
        raise ValueError(_ragged_message(size, multiple_of, why))

    # -- objective: max_batch -------------------------------------------------------------------
    def largest(self, allow_accumulation: bool, allow_checkpointing: bool, balanced: bool) -> Plan:
        plain, plain_error = self.probe(False)
        if plain is not None and plain.batch_size >= self.global_batch:
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
                why = f"largest micro-batch that fits with accumulation is {accumulated.batch_size} ({plain.batch_size} in one step)"
                return self.build(accumulated.batch_size, False, "max_batch", why, balanced)
        if not allow_checkpointing:
            if plain is None:
                raise plain_error
            raise GlobalBatchTooLargeError(self.global_batch, plain.batch_size, False, plain.device)
        ckpt, ckpt_error = self.probe_checkpointed()
        if ckpt is None:
            if plain is None:
                raise self.no_fit(plain_error, ckpt_error, True)
            why = ("no block to checkpoint was found in the model (name its blocks' classes in checkpoint_targets)"
                   if ckpt_error is None else "with it, not even batch 1 fit")
            raise accumulation_error or GlobalBatchTooLargeError(self.global_batch, plain.batch_size, False, plain.device, why)
        if ckpt.batch_size >= self.global_batch:
            why = "the global batch fits in one step only with activation checkpointing"
            return self.build(self.global_batch, True, "max_batch", why, balanced)
        if not allow_accumulation:
            raise GlobalBatchTooLargeError(self.global_batch, ckpt.batch_size, True, ckpt.device)
        accumulated = self.accumulated(ckpt, True)
        what = "batch 1" if plain is None else "an accumulated micro-batch"
        why = (f"{what} does not fit without activation checkpointing; with it, up to {accumulated.batch_size} fits "
               f"with accumulation ({ckpt.batch_size} in one step)")
        return self.build(accumulated.batch_size, True, "max_batch", why, balanced)

    def build(self, largest: int, checkpointing: bool, objective: str, reason: str, balanced: bool, **extra) -> Plan:
        """A plan for micro-batches of at most ``largest``; wraps the model when needed."""
        micro = balanced_micro_batch(self.global_batch, largest) if balanced else min(largest, self.global_batch)
        sizes = micro_batch_sizes(self.global_batch, micro, balanced=balanced)
        if checkpointing:
            self.wrap()
        else:
            self.unwrap()
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
