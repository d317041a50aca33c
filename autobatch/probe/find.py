"""find_max_batch: the largest batch size whose real training step fits in memory."""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from typing import Callable

import torch

from ..dist import agreement as distributed
from ..dist import probe as distributed_probe
from . import strategies as search
from .cache import ProbeCache, key_components, key_of
from .estimate import BatchEstimate, EstimateError, estimate_line, estimate_max_batch
from .predict import LinearFit, predictive
from ..memory.devices import SimulatedDeviceMemory, memory_for, resolve_device
from ..memory.diagnostics import memory_diagnostics
from ..errors import NoBatchFitsError
from .restore import Snapshot
from .result import ProbeResult
from .train_step import TrainStep
from .trial import TrialRunner
from ..memory.units import parse_bytes

__all__ = ["find_max_batch", "STRATEGY_NAMES"]

log = logging.getLogger("autobatch")

STRATEGY_NAMES = ("auto", "predict", "binary", "power", "halving", "estimate")
#: Where ``halving`` starts when neither ``start`` nor ``max_batch`` is given.
HALVING_DEFAULT_START = 1024
#: Where ``predict`` (and ``auto``) start when ``start`` is not given, in samples (rounded down
#: to a multiple of ``multiple_of``, at least one multiple). Why 8, not 1: the first trial's
#: peak feeds the fit and the leap (:mod:`autobatch.probe.predict`), and at batch 1 a step's peak is
#: distorted by what does not grow with the batch (the optimizer step's temporaries, cuDNN's
#: small-batch workspaces: ResNet-50's batch-1 peak lies 20 MiB, half a sample, above its
#: line). Batch 8 fits nearly every model that trains on the device; where it does not, that
#: first trial is an OOM, the cheapest trial, and the search bisects below it.
PREDICT_DEFAULT_START = 8
#: On an accelerator, the fraction of the capacity a trial's allocated peak must leave free to
#: pass: the caching allocator's room for block rounding and fragmentation. A step that fills
#: more fits only while fragmentation is kind. Measured on an H200 under a 16 GiB cap:
#: ResNet-50 at batch 370 peaked at 99.03 % allocated (99.8 % reserved) and passed 3 steps in
#: the probe, then ran out of memory at the 7th step of training in the same process; at 369
#: (98.9 %) training ran. The predictive line aims at the same limit.
ALLOCATOR_HEADROOM = 0.01


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
    search_steps: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument and what it accepts."""
    _check_positive_int("start", start)
    _check_positive_int("max_batch", max_batch)
    _check_positive_int("search_steps", search_steps)
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
    search_steps: int | None = 1,
    memory_limit: int | str | None = None,
    restore: tuple[torch.nn.Module, torch.optim.Optimizer | None] | None = None,
    device: str | torch.device | None = None,
    cache: bool | str | os.PathLike | None = None,
    cache_key: object = None,
    estimate_first: bool | None = None,
) -> ProbeResult:
    """Find the largest batch size for which ``fn(batch_size)`` runs without running out of memory.

    ``fn`` performs one real unit of work at the given batch size; for training, forward,
    backward and an optimizer step (a :class:`~autobatch.TrainStep` does exactly that). The
    first trial and the answer's trial call it ``steps_per_trial`` times, so state created
    lazily on the first step (Adam's moments) is inside the measured peak; the other trials
    call it ``search_steps`` times.

    Args:
        start: first size tried (default 1; for ``predict`` and ``auto``, 8 rounded down to a
            multiple of ``multiple_of``; for ``halving``, ``max_batch`` or 1024).
        max_batch: the largest size worth trying; the search never goes above it.
        strategy: ``auto`` (the default: ``predict``, handing over to ``binary`` where the
            memory curve cannot be fitted; for a ``TrainStep`` with no ``start``, the first
            trial lands just below the boundary that ``estimate`` predicts), ``estimate``
            (no trial at all: the largest batch whose peak, traced with fake tensors, fits
            the capacity; an untested prediction, ``result.tested`` is False), ``predict``
            (fit peak memory against batch size, jump to the predicted boundary, close the
            gap), ``binary`` (double, then bisect),
            ``power`` (largest power-of-two multiple of ``start``), ``halving`` (halve from a
            high start). ``auto``, ``predict`` and ``binary`` return the exact boundary.
        margin: fraction taken off the boundary at the end, e.g. 0.05; the reduced size is
            verified with one more trial.
        multiple_of: the result (and every size tried) is a multiple of this.
        steps_per_trial: calls of ``fn`` in a full trial (>= 1; default 3). The returned size
            has always passed a full trial (on an accelerator, one run after the last trial
            that ran out of memory), and so has the first trial, where lazy state is created.
            On an accelerator a trial passes only if its allocated peak also stays
            ``ALLOCATOR_HEADROOM`` (1 %) under the capacity.
        search_steps: calls of ``fn`` in the other trials (default 1; None: every trial is
            full). They only tell which side of the boundary a size lies on; a trial whose
            size could be the answer (the next size up already failed) runs full at once.
        memory_limit: cap the probe at this many bytes (int or "16GiB"). On CUDA the process
            is capped with ``set_per_process_memory_fraction`` and the previous cap restored;
            on the CPU the trials run under :func:`~autobatch.simulated_memory`. On the CPU
            without it, an active ``simulated_memory`` context is used, else a safe default
            budget (noted in the result).
        restore: ``(model, optimizer)`` to put back bit-exactly after probing; implied when
            ``fn`` is a ``TrainStep``.
        device: where ``fn`` runs; default the ``TrainStep``'s model device, else the current
            accelerator, else the CPU.
        cache: the persistent probe cache (see :mod:`autobatch.cache`): ``True``, ``False``,
            or a directory. Default: on for a ``TrainStep``, and for a plain callable given a
            ``cache_key``. A hit skips the probe (``result.cached`` is True).
        cache_key: what identifies a plain callable's work (a string or JSON-able data);
            required to cache one, added to the derived key for a ``TrainStep``.
        estimate_first: ``auto`` on a ``TrainStep`` places its first trial just below the
            boundary estimated with fake tensors (no OOM in the common case). Default: on for
            the CPU's simulated device, off on accelerators, where tracing a real model took
            longer than the trials it saved (README, benchmark).

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
        search_steps=search_steps,
    )
    limit_bytes = None if memory_limit is None else parse_bytes(memory_limit, name="memory_limit")
    ranks = distributed.is_distributed()
    if ranks:
        fn = distributed_probe.local_step(fn)  # trials must run no collective (see distributed_probe)
    if device is None and isinstance(fn, TrainStep):
        device = fn.device
    target = resolve_device(device)
    if restore is None and isinstance(fn, TrainStep):
        restore = (fn.model, fn.optimizer)
    after_oom = fn.clear_grads if isinstance(fn, TrainStep) else None

    if strategy == "estimate" and not isinstance(fn, TrainStep):
        raise ValueError(
            f"strategy='estimate' traces a TrainStep with fake tensors; got {type(fn).__name__}. "
            "Wrap the step in autobatch.TrainStep or pick another strategy"
        )

    began = time.perf_counter()
    probe_args = dict(
        strategy=strategy, start=start, max_batch=max_batch, margin=margin,
        multiple_of=multiple_of, steps_per_trial=steps_per_trial, search_steps=search_steps,
    )
    store, key, components, cache_note = None, None, None, None
    if cache is not False and strategy != "estimate":
        store, key, components, cache_note = _cache_lookup(
            fn, cache, cache_key, target, limit_bytes, probe_args
        )
        hit = store.get(key) if store is not None else None
        if ranks:
            hit = distributed_probe.agree_cache_hit(hit)
        if hit is not None:
            hit.elapsed_s = time.perf_counter() - began
            hit.notes.append(f"from the probe cache ({store.path_of(key)}); no trial ran")
            log.info("probe cache hit: batch %d (%s)", hit.batch_size, store.path_of(key))
            return distributed_probe.agree_batch(hit) if ranks else hit

    if strategy == "estimate":
        with memory_for(target, limit_bytes) as (memory, note):
            result = _estimate_only(fn, memory, note, max_batch=max_batch, margin=margin, multiple_of=multiple_of)
            result.diagnostics = memory_diagnostics(memory)
        result.elapsed_s = time.perf_counter() - began
        result.memory_limit_bytes = limit_bytes
        result.steps_per_trial = steps_per_trial
        log.info("estimated batch %d (untested) in %.2fs", result.batch_size, result.elapsed_s)
        return distributed_probe.agree_batch(result) if ranks else result

    snapshot = None
    if restore is not None:  # a TrainStep changes its weights only in the optimizer step: copy meanwhile
        snapshot = Snapshot.take(*restore, background=isinstance(fn, TrainStep) and fn.optimizer is restore[1])
    estimate_note = None
    try:
        with memory_for(target, limit_bytes) as (memory, note):
            agree = distributed_probe.agree_trial if ranks else None
            capacity = memory.capacity()
            if ranks:
                capacity = distributed_probe.agree_capacity(capacity)
            runner = TrialRunner(
                fn, memory, steps_per_trial, after_oom=after_oom, agree=agree, search_steps=search_steps,
                peak_limit=_peak_limit(memory, capacity),
            )
            prior = None
            if estimate_first is None:
                # measured (README, benchmark): on the CPU's simulated device tracing is cheap
                # and exact; on a GPU the traces of a real model cost seconds, more than the
                # trials they save, so auto starts from its fit there unless asked otherwise
                estimate_first = isinstance(memory, SimulatedDeviceMemory)
            if strategy == "auto" and start is None and isinstance(fn, TrainStep) and estimate_first:
                if snapshot is not None:
                    snapshot.wait()  # the trace swaps fake tensors into the model: copy before it
                prior, estimate_note = _estimate_prior(fn, memory, capacity, max_batch, multiple_of)
                if ranks:
                    prior = distributed_probe.agree_prior(prior)
            result = _search(
                runner,
                strategy=strategy,
                start=start,
                max_batch=max_batch,
                margin=margin,
                multiple_of=multiple_of,
                device_name=memory.name,
                capacity=capacity,
                prior=prior,
                confirm=not isinstance(memory, SimulatedDeviceMemory),
            )
            result.diagnostics = memory_diagnostics(memory)
    finally:
        if snapshot is not None:
            snapshot.restore()
    if prior is not None:
        result.estimate = prior[1].to_dict()
    if estimate_note:
        result.notes.append(estimate_note)
    if cache_note:
        result.notes.append(cache_note)
    result.elapsed_s = time.perf_counter() - began
    result.memory_limit_bytes = limit_bytes
    result.steps_per_trial = steps_per_trial
    if note:
        result.notes.append(note)
    if ranks:  # agreed trials describe the weakest rank, not this device: read the cache, never write it
        result, store = distributed_probe.agree_batch(result), None
    if store is not None:
        store.put(key, components, result)
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
    prior: tuple[LinearFit, BatchEstimate] | None = None,
    confirm: bool = False,
) -> ProbeResult:
    """Run the strategy in units of ``multiple_of``, apply the margin, build the result.

    A size whose next size up already failed (or that is ``max_batch``) may be the answer,
    so its trial runs all ``steps_per_trial`` steps; at the end, an answer without such a
    full pass gets one (:func:`_confirm`). With ``confirm`` (real accelerators) that full pass
    must also come after the last OOM trial, so the size is known to train in the state
    training will start from: after OOMs the allocator's cache and cuDNN's choice of
    algorithms (it falls back to ones with smaller workspaces when memory is short) differ.
    """
    used = "predict" if strategy == "auto" else strategy
    max_units = max_batch // multiple_of if max_batch is not None else 2**40
    if start is None:
        if used == "halving":
            start = max_batch or HALVING_DEFAULT_START
        elif used == "predict":
            start = max(multiple_of, PREDICT_DEFAULT_START // multiple_of * multiple_of)
        else:
            start = multiple_of
    start_units = max(1, start // multiple_of)

    def passes(units: int, purpose: str = "search") -> bool:
        above = runner.outcomes.get((units + 1) * multiple_of)
        final = units >= max_units or above is False or purpose == "margin"
        return runner(units * multiple_of, purpose, final=final)

    fit = fallback_reason = None
    if used == "predict":
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
            resident_of=resident_of,
        )
        found, used, fallback_reason = outcome.units, outcome.strategy_used, outcome.fallback_reason
        fit = outcome.fit_record(multiple_of)
        if fit is not None and usable != capacity:
            fit["allocator_headroom_bytes"] = capacity - usable
    else:
        found = search.STRATEGIES[used](passes, start_units, max_units)
    if found is not None:
        found = _confirm(runner, found, multiple_of, after_last_oom=confirm)
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


def _cache_lookup(fn, cache, cache_key, target, limit_bytes, probe_args):
    """``(store, key, components, note)`` for this probe; store None when it is not cached."""
    if cache is None and not isinstance(fn, TrainStep) and cache_key is None:
        return None, None, None, None  # default: plain callables are not cached
    directory = None if cache in (None, True) else cache
    if not isinstance(fn, TrainStep) and cache_key is None:
        return None, None, None, "not cached: a plain callable is cached only under an explicit cache_key"
    with memory_for(target, limit_bytes) as (memory, _):
        device_name, capacity = memory.name, memory.capacity()
    try:
        components = key_components(
            fn, cache_key=cache_key, device=device_name, capacity=capacity,
            memory_limit=limit_bytes,
            # the headroom decides which trials pass on an accelerator: answers found under
            # another headroom (older versions had none) are not this probe's answers
            probe={**probe_args, "allocator_headroom": ALLOCATOR_HEADROOM},
        )
    except Exception as exc:  # noqa: BLE001 - a key we cannot derive only costs the cache
        log.warning("probe cache off for this call: could not derive the key (%s: %s)", type(exc).__name__, exc)
        return None, None, None, f"not cached: could not derive the cache key ({type(exc).__name__}: {exc})"
    return ProbeCache(directory), key_of(components), components, None


def _peak_limit(memory, capacity: int | None) -> int | None:
    """The largest allocated peak a passing trial may reach: on an accelerator, the capacity
    less ``ALLOCATOR_HEADROOM``; on the simulated device (no caching allocator) no limit."""
    if capacity is None or isinstance(memory, SimulatedDeviceMemory):
        return None
    return int(capacity * (1 - ALLOCATOR_HEADROOM))


def _counts_resident(memory) -> tuple[bool, str | None]:
    """Whether the model's resident memory counts against the capacity (and a note why not):
    on an accelerator it does; a simulated CPU budget counts only what the step allocates."""
    if isinstance(memory, SimulatedDeviceMemory):
        return False, "the simulated CPU budget counts only memory the step allocates, not the model"
    return True, None


def _estimate_prior(step: TrainStep, memory, capacity: int, max_batch: int | None, multiple_of: int):
    """The estimated curve in units of ``multiple_of`` for ``auto``'s first trial, and a note;
    ``(None, note)`` when the step cannot be estimated."""
    include_resident, _ = _counts_resident(memory)
    began = time.perf_counter()
    try:
        estimate = estimate_line(
            step, capacity, include_resident=include_resident, max_batch=max_batch, multiple_of=multiple_of
        )
    except EstimateError as exc:
        return None, f"no estimate for the first trial ({exc}); probed from the start"
    if estimate.batch_size == 0 or estimate.slope_bytes_per_sample <= 0:
        return None, "the estimate predicted nothing usable; probed from the start"
    unit_slope = estimate.slope_bytes_per_sample * multiple_of
    units = estimate.batch_size // multiple_of
    assert estimate.peak_bytes is not None
    line = LinearFit(intercept=estimate.peak_bytes - unit_slope * units, slope=unit_slope)
    note = (
        f"first trial placed by an estimate (estimated boundary {estimate.batch_size}; "
        f"{len(estimate.estimates)} fake-tensor traces, {time.perf_counter() - began:.2f} s)"
    )
    return (line, estimate), note


def _estimate_only(step: TrainStep, memory, note, *, max_batch, margin, multiple_of) -> ProbeResult:
    """``strategy="estimate"``: the estimated boundary, no trials, marked untested."""
    capacity = memory.capacity()
    include_resident, why = _counts_resident(memory)
    estimate = estimate_max_batch(
        step, capacity, include_resident=include_resident, max_batch=max_batch, multiple_of=multiple_of
    )
    if estimate.batch_size == 0:
        smallest = estimate.estimates[0]
        raise NoBatchFitsError(
            batch_size=smallest.batch_size,
            capacity_bytes=capacity,
            peak_bytes=smallest.counted(include_resident),
            device=memory.name,
            last_error="estimated, not run",
            hint=None,
            diagnostics=memory_diagnostics(memory),
        )
    chosen = estimate.batch_size
    if margin:
        chosen = max(multiple_of, math.floor(chosen * (1 - margin)) // multiple_of * multiple_of)
    notes = [f"untested estimate: traced with fake tensors, no trial ran (peak {estimate.peak_bytes} B)"]
    if why:
        notes.append(why)
    if note:
        notes.append(note)
    return ProbeResult(
        batch_size=chosen,
        strategy="estimate",
        strategy_used="estimate",
        trials=[],
        capacity_bytes=capacity,
        elapsed_s=0.0,
        margin=margin,
        multiple_of=multiple_of,
        max_batch=max_batch,
        largest_passed=None,
        smallest_failed=None,
        device=memory.name,
        fit={
            "kind": "linear",
            "intercept_bytes": estimate.intercept_bytes,
            "slope_bytes_per_sample": estimate.slope_bytes_per_sample,
            "points": [],
        },
        notes=notes,
        tested=False,
        estimate=estimate.to_dict(),
    )


def _confirm(runner: TrialRunner, found: int, multiple_of: int, *, after_last_oom: bool) -> int | None:
    """Run a full trial of the answer unless one passed (after the last OOM, with
    ``after_last_oom``); step down while it fails."""
    if runner.confirmed(found * multiple_of, after_last_oom=after_last_oom):
        return found
    units = found
    while units >= 1:
        if runner.run(units * multiple_of, "confirm").passed:
            return units
        units -= max(1, units // 100)  # the edge moved: a percent at a time
    return None


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
        diagnostics=memory_diagnostics(runner.memory, failed_trial=smallest),
    )
