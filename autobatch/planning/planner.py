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

When the plan uses checkpointing the model *stays wrapped* (``Plan.checkpointing`` says so;
``Plan.undo()`` unwraps it); otherwise the model is left as it was given.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ContextManager, Iterable

import torch

from .accumulation import micro_batch_sizes, split_batch
from .checkpointing import CheckpointHandle, enable_checkpointing
from ..memory.devices import AcceleratorMemory, resolve_device
from ..errors import GlobalBatchTooLargeError, NoBatchFitsError
from ..memory.oom import free_memory
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from .throughput import (
    Candidate,
    DeviceHooks,
    balanced_micro_batch,
    candidate_micro_batches,
    leaders,
    measure_candidates,
    validate_timing,
)
from ..probe.train_step import TrainStep
from ..memory.units import format_bytes, parse_bytes

__all__ = ["Plan", "plan", "OBJECTIVES"]

log = logging.getLogger("autobatch")

OBJECTIVES = ("max_batch", "throughput")


@dataclass
class Plan:
    """How to train ``global_batch`` samples per optimizer step on this device.

    ``micro_batch`` samples per forward/backward, ``accumulation_steps`` of them per optimizer
    step; ``micro_batch_sizes`` are their exact sizes (they sum to ``global_batch``;
    ``balanced`` says which split policy made them). ``checkpointing`` and
    ``checkpointed_modules`` say whether and where activation checkpointing is on. ``probes``
    holds every probe run (``checkpointing``, ``fits``, and the ``ProbeResult`` dict as
    ``result``, or the error's figures); ``candidates`` the timed candidates of the
    throughput objective (:class:`~autobatch.planning.throughput.Candidate` as dicts) and ``timing``
    how they were timed (``warmup_steps``, ``timed_steps``, ``retime_rounds``,
    ``retime_within``, and ``retimed``: how many leaders were re-timed). ``reason`` says why
    this plan won. JSON-serialisable (``to_json`` / ``from_dict``); the live checkpoint
    handle is not serialised.
    """

    global_batch: int
    micro_batch: int
    accumulation_steps: int
    micro_batch_sizes: list[int]
    checkpointing: bool
    checkpointed_modules: list[str] = field(default_factory=list)
    balanced: bool = True
    objective: str = "max_batch"
    reason: str = ""
    probes: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    handle: CheckpointHandle | None = field(default=None, repr=False, compare=False)

    # -- using the plan -------------------------------------------------------------------
    def split(self, batch: Any) -> list[Any]:
        """Split a global batch into this plan's micro-batches."""
        return split_batch(batch, self.micro_batch, balanced=self.balanced)

    def apply(self, model: Any) -> CheckpointHandle | None:
        """Turn this plan's checkpointing on for ``model`` (e.g. a plan loaded from JSON)."""
        if not self.checkpointing:
            return None
        self.handle = enable_checkpointing(model, modules=self.checkpointed_modules)
        return self.handle

    def undo(self) -> None:
        """Remove the activation checkpointing this plan turned on (a no-op without it)."""
        if self.handle is not None:
            self.handle.undo()

    @property
    def probe_results(self) -> list[ProbeResult]:
        """The successful probes as :class:`ProbeResult` objects."""
        return [ProbeResult.from_dict(p["result"]) for p in self.probes if p.get("result")]

    @property
    def samples_per_s(self) -> float | None:
        """The chosen candidate's samples/s at its median step time (throughput objective only)."""
        for candidate in self.candidates:
            if candidate.get("chosen"):
                return candidate.get("samples_per_s")
        return None

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "handle"}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        known = {f.name for f in fields(cls)} - {"handle"}
        return cls(**{key: value for key, value in data.items() if key in known})

    def summary(self) -> str:
        """A few readable lines; for the throughput objective, a table of the candidates."""
        lines = [
            f"global batch    {self.global_batch}",
            f"micro-batch     {self.micro_batch} x {self.accumulation_steps} accumulation steps"
            + (f" (sizes {_short(self.micro_batch_sizes)})" if self.accumulation_steps > 1 else ""),
            f"checkpointing   "
            + (f"on, {len(self.checkpointed_modules)} modules ({_short(self.checkpointed_modules)})" if self.checkpointing else "off"),
            f"objective       {self.objective}",
            f"reason          {self.reason}",
        ]
        lines.extend(f"note            {note}" for note in self.notes)
        if self.candidates:
            lines.append("")
            lines.append(candidates_table(self.candidates))
        return "\n".join(lines)


def candidates_table(candidates: Iterable[dict[str, Any]]) -> str:
    """A markdown table of timed candidates: samples/s at the median step, the median step,
    how many steps were timed (in how many rounds), allocator retries ("-": not measured);
    the chosen one marked, one with allocator retries flagged."""
    rows = [
        "| micro-batch | accumulation | checkpointing | samples/s | median s/step | timed steps | alloc retries | |",
        "| ---: | ---: | :---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in candidates:
        speed = "OOM" if c.get("error") else ("-" if c.get("samples_per_s") is None else f"{c['samples_per_s']:.1f}")
        per_step = "-" if c.get("seconds_per_step") is None else f"{c['seconds_per_step']:.4f}"
        steps = len(c.get("step_seconds") or [])
        timed = f"{steps} ({c.get('rounds', 1)} rounds)" if c.get("rounds", 1) > 1 else (str(steps) if steps else "-")
        retries = "-" if c.get("alloc_retries") is None else str(c["alloc_retries"])
        marks = (["**chosen**"] if c.get("chosen") else []) + (["allocator retries"] if c.get("alloc_retries") else [])
        rows.append(
            f"| {c['micro_batch']} | {c['accumulation_steps']} | {'yes' if c['checkpointing'] else 'no'} "
            f"| {speed} | {per_step} | {timed} | {retries} | {', '.join(marks)} |"
        )
    return "\n".join(rows)


# -- planning -------------------------------------------------------------------------------
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
        ValueError: a bad argument.
        NoBatchFitsError: batch 1 does not fit even with checkpointing (or checkpointing is
            not allowed, or found nothing to wrap); the message gives both attempts' figures.
        GlobalBatchTooLargeError: the global batch does not fit in one step and accumulation
            is not allowed.
    """
    _validate(step, global_batch, objective, probe_kwargs)
    timing = dict(
        warmup_steps=warmup_steps, timed_steps=timed_steps, retime_rounds=retime_rounds, retime_within=retime_within
    )
    validate_timing(**timing)
    cap = min(global_batch, probe_kwargs.pop("max_batch", None) or global_batch)
    multiple_of = probe_kwargs.get("multiple_of", 1)
    if balanced and isinstance(multiple_of, int) and multiple_of > 1:
        balanced = False  # balanced sizes would not be multiples; full chunks and a smaller last one
    planner = _Planner(step, global_batch, cap, checkpoint_targets, probe_kwargs)
    try:
        if objective == "max_batch":
            result = planner.largest(allow_accumulation, allow_checkpointing, balanced)
        else:
            result = planner.fastest(
                allow_accumulation,
                allow_checkpointing,
                balanced,
                min_micro_batch=min_micro_batch,
                exhaustive=exhaustive,
                timing=timing,
                timer=timer,
                allocator_retries=allocator_retries,
            )
    except BaseException:
        planner.unwrap()
        raise
    log.info(
        "plan: global %d = %d x %d micro-batches, checkpointing %s (%s)",
        result.global_batch,
        result.micro_batch,
        result.accumulation_steps,
        "on" if result.checkpointing else "off",
        result.reason,
    )
    return result


def _validate(step, global_batch, objective, probe_kwargs) -> None:
    missing = [name for name in ("model", "optimizer", "loss_fn", "make_batch") if not hasattr(step, name)]
    if missing:
        raise TypeError(f"step must be an autobatch.TrainStep (it lacks {', '.join(missing)}), got {step!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch <= 0:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if not isinstance(probe_kwargs.get("max_batch", 1), (int, type(None))):
        raise ValueError(f"max_batch must be a positive integer or None, got {probe_kwargs['max_batch']!r}")


class _Planner:
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
    def probe(self, checkpointing: bool) -> tuple[ProbeResult | None, NoBatchFitsError | None]:
        """Probe the largest batch up to the cap in the model's current wrapping."""
        try:
            result = find_max_batch(self.step, max_batch=self.cap, **self.probe_kwargs)
        except NoBatchFitsError as exc:
            error = exc
        else:
            self.probes.append({"checkpointing": checkpointing, "fits": True, "result": result.to_dict()})
            return result, None
        free_memory()
        self.probes.append(
            {
                "checkpointing": checkpointing,
                "fits": False,
                "result": None,
                "batch_size": error.batch_size,
                "peak_bytes": error.peak_bytes,
                "capacity_bytes": error.capacity_bytes,
                "device": error.device,
                "error": str(error),
            }
        )
        return None, error

    def wrap(self) -> bool:
        """Turn checkpointing on; False (with a note) when there is nothing to wrap."""
        if self.handle is None or not self.handle.active:
            self.handle = enable_checkpointing(self.step.model, self.targets)
        if not self.handle.modules:
            self.notes.append(
                "activation checkpointing found no repeated blocks to wrap (no nn.Sequential / "
                "nn.ModuleList with repeated children); name the block classes in checkpoint_targets"
            )
            return False
        return True

    def unwrap(self) -> None:
        if self.handle is not None:
            self.handle.undo()

    def probe_checkpointed(self) -> tuple[ProbeResult | None, NoBatchFitsError | None]:
        if not self.wrap():
            return None, None
        result, error = self.probe(True)
        self.unwrap()
        return result, error

    def no_fit(self, plain_error: NoBatchFitsError, checkpoint_error: NoBatchFitsError | None, allowed: bool):
        """The NoBatchFitsError for "not even batch 1", with both attempts' figures."""
        if not allowed:
            return plain_error
        if checkpoint_error is None:  # nothing to wrap
            return self._attempts_error(
                plain_error,
                "Activation checkpointing was tried but found no repeated blocks to wrap; name the "
                "block classes in checkpoint_targets, or try lower precision, a smaller model or "
                "sequence length, or a larger memory_limit / device.",
            )
        modules = self.handle.modules if self.handle is not None else []
        return self._attempts_error(
            checkpoint_error,
            f"This is with activation checkpointing of {len(modules)} blocks "
            f"({_short(modules)}); without it batch {plain_error.batch_size} peaked at "
            f"{format_bytes(plain_error.peak_bytes)} before failing. Try lower precision "
            "(bf16/fp16 autocast), a smaller model or sequence length, or a larger memory_limit / device.",
        )

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

    # -- objective: max_batch -------------------------------------------------------------------
    def largest(self, allow_accumulation: bool, allow_checkpointing: bool, balanced: bool) -> Plan:
        plain, plain_error = self.probe(False)
        if plain is not None and plain.batch_size >= self.global_batch:
            return self.build(self.global_batch, False, "max_batch", "the global batch fits in one step", balanced)
        if plain is not None and allow_accumulation:
            return self.build(
                plain.batch_size,
                False,
                "max_batch",
                f"largest micro-batch that fits is {plain.batch_size}",
                balanced,
            )
        if not allow_checkpointing:
            if plain is None:
                raise plain_error
            raise GlobalBatchTooLargeError(self.global_batch, plain.batch_size, False, plain.device)
        ckpt, ckpt_error = self.probe_checkpointed()
        if ckpt is None:
            if plain is None:
                raise self.no_fit(plain_error, ckpt_error, True)
            raise GlobalBatchTooLargeError(self.global_batch, plain.batch_size, False, plain.device)
        if ckpt.batch_size >= self.global_batch:
            why = "the global batch fits in one step only with activation checkpointing"
            return self.build(self.global_batch, True, "max_batch", why, balanced)
        if not allow_accumulation:
            raise GlobalBatchTooLargeError(self.global_batch, ckpt.batch_size, True, ckpt.device)
        why = f"batch 1 does not fit without activation checkpointing; with it, up to {ckpt.batch_size} fits"
        return self.build(ckpt.batch_size, True, "max_batch", why, balanced)

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

    # -- objective: throughput ------------------------------------------------------------------
    def fastest(
        self,
        allow_accumulation: bool,
        allow_checkpointing: bool,
        balanced: bool,
        *,
        min_micro_batch: int | None,
        exhaustive: bool,
        timing: dict[str, Any],
        timer: Callable[[], float],
        allocator_retries: Callable[[], int | None] | None,
    ) -> Plan:
        plain, plain_error = self.probe(False)
        plain_max = plain.batch_size if plain is not None else 0
        ckpt = ckpt_error = None
        if allow_checkpointing and (exhaustive or plain_max < self.global_batch):
            ckpt, ckpt_error = self.probe_checkpointed()
        if plain is None and ckpt is None:
            raise self.no_fit(plain_error, ckpt_error, allow_checkpointing)
        ckpt_max = ckpt.batch_size if ckpt is not None else 0

        def sizes(largest: int, above: int = 0) -> list[int]:
            if largest == 0:
                return []
            if not allow_accumulation:
                return [self.global_batch] if largest >= self.global_batch else []
            multiple_of = self.probe_kwargs.get("multiple_of", 1)
            found = candidate_micro_batches(
                self.global_batch, largest, smallest=min_micro_batch, multiple_of=multiple_of
            )
            return [size for size in found if size > above]

        plain_candidates = [Candidate.build(self.global_batch, m, False, balanced=balanced) for m in sizes(plain_max)]
        ckpt_candidates = [
            Candidate.build(self.global_batch, m, True, balanced=balanced)
            for m in sizes(ckpt_max, 0 if exhaustive else plain_max)
        ]
        if not plain_candidates and not ckpt_candidates:
            largest, wrapped = max((plain_max, False), (ckpt_max, True))
            raise GlobalBatchTooLargeError(self.global_batch, largest, wrapped, (plain or ckpt).device)

        device = resolve_device(self.probe_kwargs.get("device") or self.step.device)
        if device.type == "cpu":
            self.notes.append(
                "CPU: candidates were timed without the simulated memory budget (it slows every "
                "operator); the probes had already checked that they fit"
            )
        candidates = sorted(plain_candidates + ckpt_candidates, key=lambda c: (c.checkpointing, c.micro_batch))
        retimed = self.time(candidates, device, timing, timer, allocator_retries)
        timed = [c for c in candidates if c.samples_per_s is not None]
        if not timed:
            raise MemoryError(
                "every candidate plan ran out of memory while being timed, though the probe found "
                f"them to fit: {[c.error for c in candidates]}; lower memory pressure (margin=0.1)"
            )
        # Fastest median first; ties go to fewer accumulation steps, then to no checkpointing.
        best = max(timed, key=lambda c: (c.samples_per_s, -c.accumulation_steps, not c.checkpointing))
        best.chosen = True
        reason = (
            f"fastest of {len(timed)} timed candidates at the median step: {best.samples_per_s:.1f} samples/s "
            f"(micro-batch {best.micro_batch} x {best.accumulation_steps}, checkpointing "
            f"{'on' if best.checkpointing else 'off'})"
        )
        if retimed:
            reason += (
                f"; the {len(retimed)} within {timing['retime_within']:.0%} of the best were re-timed in "
                f"{timing['retime_rounds']} interleaved rounds"
            )
        if best.retried:
            self.notes.append(
                f"the chosen candidate hit {best.alloc_retries} allocator retries while timed (memory "
                "pressure: the cache was flushed to retry an allocation); its median includes them"
            )
        return self.build(
            best.micro_batch,
            best.checkpointing,
            "throughput",
            reason,
            balanced,
            candidates=[c.to_dict() for c in candidates],
            timing=dict(timing, retimed=len(retimed)),
        )

    def time(self, candidates, device, timing, timer, allocator_retries) -> list[Candidate]:
        """Time every candidate once, then the leaders in interleaved rounds; return the
        re-timed leaders (none when fewer than two lead or ``retime_rounds`` is 0)."""
        options = dict(
            global_batch=self.global_batch,
            warmup_steps=timing["warmup_steps"],
            timed_steps=timing["timed_steps"],
            timer=timer,
            hooks=DeviceHooks.for_device(device, allocator_retries),
            prepare=lambda candidate: self.wrap() if candidate.checkpointing else self.unwrap(),
        )
        with _measurement_memory(device, self.probe_kwargs.get("memory_limit")):
            try:
                measure_candidates(self.step, candidates, **options)
                front = leaders(candidates, timing["retime_within"])
                if len(front) < 2 or not timing["retime_rounds"]:
                    return []
                measure_candidates(self.step, front, rounds=timing["retime_rounds"], **options)
                return front
            finally:
                self.unwrap()


def _measurement_memory(device: torch.device, memory_limit: int | str | None) -> ContextManager:
    """Accelerators: time under the same cap the probe used. CPU: no simulated budget."""
    if device.type == "cpu" or memory_limit is None:
        return nullcontext()
    return AcceleratorMemory(device).capped(parse_bytes(memory_limit, name="memory_limit"))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _short(items: list[Any], limit: int = 4) -> str:
    shown = ", ".join(str(item) for item in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")
