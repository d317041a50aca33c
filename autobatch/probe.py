"""find_max_batch: the largest batch size whose real training step fits in memory."""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from typing import Callable

import torch

from . import search
from .predict import predictive
from .devices import memory_for, resolve_device
from .errors import NoBatchFitsError
from .restore import Snapshot
from .result import ProbeResult
from .train_step import TrainStep
from .trial import TrialRunner
from .units import parse_bytes

__all__ = ["find_max_batch", "STRATEGY_NAMES"]

log = logging.getLogger("autobatch")

STRATEGY_NAMES = ("auto", "predict", "binary", "power", "halving")
#: Where ``halving`` starts when neither ``start`` nor ``max_batch`` is given.
HALVING_DEFAULT_START = 1024


def _check_positive_int(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def validate_probe_args(
    *,
    start: int | None,
    max_batch: int | None,
    strategy: str,
    margin: float,
    multiple_of: int,
    steps_per_trial: int,
) -> None:
    """Raise ``ValueError`` naming the argument and what it accepts."""
    _check_positive_int("start", start)
    _check_positive_int("max_batch", max_batch)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"multiple_of must be a positive integer, got {multiple_of!r}")
    if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(f"steps_per_trial must be an integer >= 1, got {steps_per_trial!r}")
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGY_NAMES)}; got {strategy!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be a fraction in [0, 1), e.g. 0.05 for 5%; got {margin!r}")
    if start is not None and max_batch is not None and start > max_batch:
        raise ValueError(f"start={start} is larger than max_batch={max_batch}; lower start or raise max_batch")
    if max_batch is not None and max_batch < multiple_of:
        raise ValueError(
            f"max_batch={max_batch} is smaller than multiple_of={multiple_of}, so no batch size "
            "is allowed; raise max_batch or lower multiple_of"
        )


def find_max_batch(
    fn: Callable[[int], object],
    *,
    start: int | None = None,
    max_batch: int | None = None,
    strategy: str = "auto",
    margin: float = 0.0,
    multiple_of: int = 1,
    steps_per_trial: int = 3,
    memory_limit: int | str | None = None,
    restore: tuple[torch.nn.Module, torch.optim.Optimizer | None] | None = None,
    device: str | torch.device | None = None,
) -> ProbeResult:
    """Find the largest batch size for which ``fn(batch_size)`` runs without running out of memory.

    ``fn`` performs one real unit of work at the given batch size; for training, forward,
    backward and an optimizer step (a :class:`~autobatch.TrainStep` does exactly that). A trial
    calls it ``steps_per_trial`` times, so state created lazily on the first step (Adam's
    moments) is inside the measured peak.

    Args:
        start: first size tried (default 1; for ``halving``, ``max_batch`` or 1024).
        max_batch: the largest size worth trying; the search never goes above it.
        strategy: ``auto`` (the default: ``predict``, handing over to ``binary`` where the
            memory curve cannot be fitted), ``predict`` (fit peak memory against batch size,
            jump to the predicted boundary, close the gap), ``binary`` (double, then bisect),
            ``power`` (largest power-of-two multiple of ``start``), ``halving`` (halve from a
            high start). ``auto``, ``predict`` and ``binary`` return the exact boundary.
        margin: fraction taken off the boundary at the end, e.g. 0.05; the reduced size is
            verified with one more trial.
        multiple_of: the result (and every size tried) is a multiple of this.
        steps_per_trial: calls of ``fn`` per trial (>= 1; default 3).
        memory_limit: cap the probe at this many bytes (int or "16GiB"). On CUDA the process
            is capped with ``set_per_process_memory_fraction`` and the previous cap restored;
            on the CPU the trials run under :func:`~autobatch.simulated_memory`. On the CPU
            without it, an active ``simulated_memory`` context is used, else a safe default
            budget (noted in the result).
        restore: ``(model, optimizer)`` to put back bit-exactly after probing; implied when
            ``fn`` is a ``TrainStep``.
        device: where ``fn`` runs; default the ``TrainStep``'s model device, else the current
            accelerator, else the CPU.

    Raises:
        ValueError: a bad argument (the message names it and the accepted values).
        NoBatchFitsError: even the smallest allowed batch ran out of memory.
    """
    validate_probe_args(
        start=start,
        max_batch=max_batch,
        strategy=strategy,
        margin=margin,
        multiple_of=multiple_of,
        steps_per_trial=steps_per_trial,
    )
    limit_bytes = None if memory_limit is None else parse_bytes(memory_limit, name="memory_limit")
    if device is None and isinstance(fn, TrainStep):
        device = fn.device
    target = resolve_device(device)
    if restore is None and isinstance(fn, TrainStep):
        restore = (fn.model, fn.optimizer)
    after_oom = fn.clear_grads if isinstance(fn, TrainStep) else None

    began = time.perf_counter()
    snapshot = Snapshot.take(*restore) if restore is not None else None
    try:
        with memory_for(target, limit_bytes) as (memory, note):
            runner = TrialRunner(fn, memory, steps_per_trial, after_oom=after_oom)
            capacity = memory.capacity()
            result = _search(
                runner,
                strategy=strategy,
                start=start,
                max_batch=max_batch,
                margin=margin,
                multiple_of=multiple_of,
                device_name=memory.name,
                capacity=capacity,
            )
    finally:
        if snapshot is not None:
            snapshot.restore()
    result.elapsed_s = time.perf_counter() - began
    result.memory_limit_bytes = limit_bytes
    result.steps_per_trial = steps_per_trial
    if note:
        result.notes.append(note)
    log.info(
        "probe found batch %d with %s in %d trials (%.2fs)",
        result.batch_size,
        result.strategy_used,
        result.num_trials,
        result.elapsed_s,
    )
    return result


def _search(
    runner: TrialRunner,
    *,
    strategy: str,
    start: int | None,
    max_batch: int | None,
    margin: float,
    multiple_of: int,
    device_name: str,
    capacity: int | None,
) -> ProbeResult:
    """Run the strategy in units of ``multiple_of``, apply the margin, build the result."""
    used = "predict" if strategy == "auto" else strategy
    max_units = max_batch // multiple_of if max_batch is not None else 2**40
    if start is None:
        start = (max_batch or HALVING_DEFAULT_START) if used == "halving" else multiple_of
    start_units = max(1, start // multiple_of)

    def passes(units: int, purpose: str = "search") -> bool:
        return runner(units * multiple_of, purpose)

    fit = fallback_reason = None
    if used == "predict":
        def peak_of(units: int) -> int | None:
            return runner.peak_of(units * multiple_of)

        outcome = predictive(passes, peak_of, start_units, max_units, capacity)
        found, used, fallback_reason = outcome.units, outcome.strategy_used, outcome.fallback_reason
        fit = outcome.fit_record(multiple_of)
    else:
        found = search.STRATEGIES[used](passes, start_units, max_units)
    if found is None:
        _raise_no_fit(runner, multiple_of, device_name, capacity)
    largest_passed = found * multiple_of
    chosen = _apply_margin(passes, found, margin, multiple_of)
    if chosen is None:
        _raise_no_fit(runner, multiple_of, device_name, capacity)
    failed_above = [b for b in runner.failed_sizes if b > largest_passed]
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
    )


def _apply_margin(passes, found_units: int, margin: float, multiple_of: int) -> int | None:
    """Shrink the boundary by ``margin`` and verify the smaller size with a real trial.

    Memory very nearly grows with batch size, so the verification almost always passes; if
    it does not (a pathological step), halve further until one does.
    """
    if margin == 0:
        return found_units
    units = max(1, math.floor(found_units * multiple_of * (1 - margin)) // multiple_of)
    while units >= 1:
        if passes(units, "margin"):
            return units
        units //= 2
    return None


def _raise_no_fit(runner: TrialRunner, multiple_of: int, device_name: str, capacity: int | None):
    failures = [record for record in runner.records if not record.passed]
    smallest = min(failures, key=lambda record: record.batch_size)
    hint = None
    if multiple_of > 1:
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
    )
