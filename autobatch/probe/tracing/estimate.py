"""Know before you run: the peak memory of a training step, without allocating it.

The step is traced under ``FakeTensorMode``: every operator runs on fake tensors that carry
shape, dtype and device but no data, so a step at any batch size costs the same few
milliseconds and no memory. The model's parameters and buffers, and the optimizer's state,
are swapped for fake copies for the duration (tied weights stay tied: one fake per real
tensor); the user's model and optimizer are never written to. Allocations are counted by the
same :class:`~autobatch.memory.accounting.StorageAccountant` that backs
:func:`~autobatch.simulated_memory`, so what is counted is exactly what a simulated trial
counts: activations saved for backward, gradients, optimizer state created on the first
``step()`` (two steps are traced, so the second sees it, and more while a step made state:
:func:`~autobatch.probe.tracing.fake_trace.trace_steps`), autocast's casts, checkpointing's
recomputation, and the temporaries of each operator's outputs.

cuBLAS's workspaces are not tensors either, but their sizes are known: on CUDA the estimate
adds one per thread that ran a matrix product (:mod:`autobatch.memory.workspaces`). What it does not
see: cuDNN's per-call convolution workspaces, allocator fragmentation, and memory that is
not a tensor (the CUDA context). A step it knows it would count short (an LSTM on the CPU,
sparse gradients) raises :class:`EstimateError`, and ``auto`` probes with trials instead. Kernels are chosen for the
device the model lives on, so a CPU-resident model is estimated with CPU kernels (e.g.
attention's math path saves the attention matrix where CUDA's flash path does not).

Peak memory is very nearly linear in the batch size once activations dominate, so
:func:`estimate_max_batch` brackets the capacity with traces at 1, 8, 64, ... and closes the
bracket by solving the line through its ends and tracing the guess and its neighbour
(bisecting when that stalls); the answer is the exact estimated boundary in a handful of
traces.
"""

from __future__ import annotations

import copy
import logging
import math
from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ...memory.accounting import OperationLimit, StorageAccountant
from ... import checks
from ..arguments import SEARCH_CEILING, IteratorBatchError, refuse_iterator, validate_probe_args, validate_step
from .bent_curve import CURVE_TRACES, follow_bend
from .flat_peak import past_flat
from .fake_trace import (FakeWorld, KernelDtypes, TraceScaler, loss_module, quiet_meta_errors, resident_bytes, trace_steps,
                         unvalidated_distributions)
from ..snapshot.rng import rng_state, set_rng_state, step_generators
from ..snapshot.shards import has_dtensors
from .trace_failures import RealBatches, cut_below_user_code, from_the_step, refused_size, step_error, untraceable, untraceable_memory
from .trace_writes import RealWrites
from ..train_step import TrainStep
from ...memory.uncompiled import uncompiled
from ...memory.units import format_bytes, parse_bytes
from ...memory.workspaces import BlasThreads, workspace_bytes
from .estimate_records import BatchEstimate, EstimateError, MemoryEstimate
from .trace_budget import OperationBudget
from .trace_cost import TraceCost

__all__ = ["EstimateError", "MemoryEstimate", "BatchEstimate", "estimate_memory", "estimate_peak", "estimate_max_batch"]

log = logging.getLogger("autobatch")

#: Block granularity of the CUDA caching allocator; allocations are rounded up to it.
CUDA_BLOCK_BYTES = 512
#: Size ratio between the traces that bracket the boundary.
GROWTH = 8
#: At most this many refining traces inside the bracket.
MAX_REFINE = 16
#: Peers' names for the estimates' keywords, suggested where given (:func:`~autobatch.checks.keywords`).
ESTIMATE_ALIASES = {"max_memory": "capacity", "memory": "capacity", "limit": "capacity", "budget": "capacity",
                    "max_batch_size": "max_batch", "batch": "batch_size", "size": "batch_size"}
#: What to do instead, said by every refusal.
TRIALS = "probe with real trials (strategy='binary', or 'auto' with estimate_first=False)"


@checks.keywords(ESTIMATE_ALIASES)
def estimate_memory(step: TrainStep, batch_size: int, *, steps: int = 2, op_limit: int | None = None) -> MemoryEstimate:
    """Estimate the memory of ``steps`` training steps of ``step`` at ``batch_size``.

    Nothing is allocated and neither the model nor the optimizer is changed (nor any random
    generator). Raises :class:`EstimateError` when the step cannot be traced with fake tensors,
    or when the trace left a fake tensor where it cannot be taken back (the model is then
    restored as far as the estimate reaches, and trials must measure the step). An error the
    step's own code raised (a ``KeyError`` in its collate, a shape mismatch in its loss) is raised
    as itself, with a note (:func:`~autobatch.probe.tracing.trace_failures.step_error`). Past ``op_limit``
    operators the trace stops with :class:`~autobatch.memory.accounting.OperationLimit`.
    """
    _refuse_unestimable(step)
    batch_size = checks.positive_int("batch_size", batch_size)  # a plain int: the estimate is stored (to_dict)
    steps = checks.positive_int("steps", steps)
    op_limit = checks.positive_int("op_limit", op_limit, allow_none=True)  # else compared inside the trace: "'>' not supported"
    device = step.device
    round_to = CUDA_BLOCK_BYTES if device.type == "cuda" else 1
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    world = FakeWorld(step, mode, device, round_to)
    refusal = world.refusal()
    if refusal is not None:
        raise EstimateError(f"{refusal}; {TRIALS}")
    resident = resident_bytes(step, device, round_to)
    accountant = StorageAccountant(world.counts, round_to=round_to)
    accountant.op_limit = op_limit
    blas = BlasThreads()
    rng, failure = rng_state(own=step_generators(step)), None
    try:
        with ExitStack() as stack:
            stack.callback(world.swap_out)  # first: a swap that fails part-way is put back too
            world.swap_in()
            fake_step = copy.copy(step)
            fake_step.optimizer = world.optimizer()
            if step.grad_scaler is not None:
                fake_step.grad_scaler = TraceScaler()
            if step.make_batch is not None:  # built for real where its fake version reads the data's values
                batches = RealBatches(step.make_batch, accountant, world)
                fake_step.make_batch = lambda n: refuse_iterator(batches(n))  # a generator's: the probe's error
            stack.enter_context(quiet_meta_errors())  # the error is the EstimateError's cause, not a log
            stack.enter_context(unvalidated_distributions())  # a Distribution's value checks: none on fakes
            stack.enter_context(uncompiled())  # a compiled model traced eagerly, and compiled again after
            stack.enter_context(mode)
            stack.enter_context(RealWrites())  # above the fake mode: real tensors it writes (an EMA attribute) put back
            stack.enter_context(KernelDtypes())  # real kernels' dtypes, between the fake mode and the accountant
            stack.enter_context(accountant)
            stack.enter_context(blas)
            growth = trace_steps(fake_step, batch_size, steps, accountant)
            del fake_step
    except Exception as exc:  # noqa: BLE001 - anything fake tracing cannot do: raised below, with what it left
        failure = exc
    finally:
        set_rng_state(rng)
    left = world.leftover()  # put back what it can; where else a fake is kept, it cannot
    if left:
        dropped = " (dropped)" if left.endswith(".grad") else ""
        left = f"the trace left a fake tensor{dropped} in {left}, outside the modules' state it puts back"
    if isinstance(failure, (OperationLimit, IteratorBatchError)):  # not the step's own error: raised as it is
        raise failure
    if failure is not None:
        own = step_error(failure, batch_size, left, TRIALS)  # the step's own error: raised as itself
        if own is not None:
            raise own
        traced = f"could not trace the step with fake tensors: {untraceable(failure)}"
        raise EstimateError(traced + (f"; {left}" if left else "") + f"; {TRIALS}") from cut_below_user_code(failure)
    if left:
        raise EstimateError(f"{left}; {TRIALS}")
    workspaces = workspace_bytes(device, len(blas.threads))
    return MemoryEstimate(batch_size, resident + world.existing_bytes, accountant.peak_bytes, str(device), workspaces,
                          accountant.operations, growth)


@checks.keywords(ESTIMATE_ALIASES)
def estimate_peak(step: TrainStep, batch_size: int, *, include_resident: bool = True, steps: int = 2) -> int:
    """Estimated peak bytes of a training step at ``batch_size``; with ``include_resident``
    (the default) the model's parameters, buffers and optimizer state are included, as
    ``torch.cuda.max_memory_allocated`` includes them."""
    checks.flag("include_resident", include_resident)
    return estimate_memory(step, batch_size, steps=steps).counted(include_resident)


def _refuse_unestimable(step: Any) -> None:
    """Raise :class:`EstimateError` for a step the fake-tensor trace cannot estimate."""
    if not isinstance(step, TrainStep):
        what = "a model" if isinstance(step, torch.nn.Module) else "a plain function" if callable(step) else "no step"
        raise EstimateError(
            f"only a TrainStep can be estimated, not {type(step).__name__} ({what}): pass "
            "autobatch.TrainStep(model, optimizer, loss_fn, make_batch), whose model, optimizer and batch the trace "
            f"swaps for fakes; {TRIALS} for another step")
    validate_step(step, "estimate")  # a TrainStep without make_batch: say what to pass
    reason = untraceable_memory(step, loss_module(step))  # the loss module is traced as the model is
    if reason is not None:
        raise EstimateError(f"{reason}; {TRIALS}")
    if has_dtensors(step.model):
        raise EstimateError(
            "the model has DTensor parameters (FSDP2 fully_shard, or tensor parallel): the fake-tensor trace "
            f"cannot run their all-gathers and reduce-scatters, so it cannot tell what one rank holds at its peak; {TRIALS}"
        )


def _tracer(step: TrainStep, *, multiple_of: int, max_batch: int | None, steps: int, include_resident: bool,
            op_growth: float | None = None, cost: TraceCost | None = None):
    """``(traced, peak, max_batch, multiple_of)``: ``peak(units)`` traces batch ``units * multiple_of``
    once (memoised in ``traced``, keyed by units) and returns its estimated peak, with or without the
    resident model; with ``op_growth``, a trace running that many times the first's operators is an
    :class:`EstimateError` (:mod:`~autobatch.probe.tracing.trace_budget`); with ``cost``, the first trace is
    weighed against a real step (:mod:`~autobatch.probe.tracing.trace_cost`). Checks the arguments as
    :func:`~autobatch.find_max_batch` does (plain ints back)."""
    _refuse_unestimable(step)
    given = validate_probe_args(start=None, max_batch=max_batch, strategy="estimate", margin=0.0,
                                multiple_of=multiple_of, steps_per_trial=1)
    max_batch, multiple_of, steps = given["max_batch"], given["multiple_of"], checks.positive_int("steps", steps)
    checks.flag("include_resident", include_resident)  # "no" is truthy: it would count the resident model
    traced: dict[int, MemoryEstimate] = {}
    budget = OperationBudget(op_growth)

    def peak(units: int) -> int:
        if units not in traced:
            try:
                def trace() -> MemoryEstimate:
                    return estimate_memory(step, units * multiple_of, steps=steps, op_limit=budget.limit())

                traced[units] = trace() if cost is None or traced else cost.first(trace)
            except OperationLimit:
                raise EstimateError(f"{budget.refusal(units * multiple_of)}; {TRIALS}") from None
            except Exception as exc:  # noqa: BLE001 - raised; the step's own error at one size says so
                refused_size(exc, units * multiple_of, [u * multiple_of for u in traced])
                raise
            budget.record(units * multiple_of, traced[units].operations)
        return traced[units].counted(include_resident)

    return traced, peak, max_batch, multiple_of


def _smallest_traced(peak: Callable[[int], int], max_units: int | None) -> int:
    """1, or 2 where a step cannot run at one unit but can at two (``BatchNorm`` in training
    needs more than one value per channel, its own ``ValueError``; the probe's first trial is
    larger anyway). Where both fail, the error at two is raised."""
    try:
        peak(1)
        return 1
    except Exception as exc:  # noqa: BLE001 - the estimate's or the step's own (from_the_step); others raised
        if not (isinstance(exc, EstimateError) or from_the_step(exc)) or (max_units is not None and max_units < 2):
            raise
    peak(2)
    return 2


def estimate_line(
    step: TrainStep,
    capacity: int | str,
    *,
    include_resident: bool = True,
    max_batch: int | None = None,
    multiple_of: int = 1,
    sizes: tuple[int, int] = (16, 256),
    steps: int = 2,
    op_growth: float | None = None,
    cost: TraceCost | None = None,
) -> BatchEstimate:
    """A quick estimate from three traces: the line through the estimated peaks at
    ``sizes`` is solved for ``capacity``, the step is traced once more at that answer, and the
    secant through the two largest traces gives the estimate, or where the curve bends the secant
    method on from it (:func:`~autobatch.probe.tracing.bent_curve.follow_bend`). Where the peaks at ``sizes``
    are equal (the optimizer step's constant peak above the activations') it traces on by ``GROWTH``
    until the peak grows (:func:`~autobatch.probe.tracing.flat_peak.past_flat`). Tracing costs the same at
    any batch size where the step's operators do not grow with it (``op_growth`` stops a trace
    that runs that many times the first's: :mod:`~autobatch.probe.tracing.trace_budget`), so this is far cheaper
    than :func:`estimate_max_batch`, which traces until it lands on the estimated boundary exactly;
    ``auto`` uses it to place its first real trial (``cost``: where its first trace costs more than
    the search's real steps, it stops, :mod:`~autobatch.probe.tracing.trace_cost`).
    """
    capacity_bytes = parse_bytes(capacity, name="capacity")
    traced, peak, max_batch, multiple_of = _tracer(step, multiple_of=multiple_of, max_batch=max_batch, steps=steps,
                                                   include_resident=include_resident, op_growth=op_growth, cost=cost)
    max_units = max_batch // multiple_of if max_batch is not None else None

    def solve(a: int, b: int, *, steps: int = 0) -> tuple[int, float, float]:
        solved = follow_bend(peak, a, b, capacity_bytes, max_units, steps=steps) if a != b else None
        if solved is None:
            raise EstimateError("estimated peak does not grow with the batch")
        return solved

    peak(min(sizes))  # the smallest first: its operators are the budget of the rest (op_growth)
    low, high = past_flat(peak, *sizes, capacity_bytes, growth=GROWTH, max_units=max_units, multiple_of=multiple_of,
                          flat_units=GROWTH**6)  # the optimizer step's constant peak first: trace on till it grows
    units, intercept, slope = solve(low, high)
    if units > high or (high != sizes[1] and low < units < high):  # the secant nearest the answer, on to a bend's
        units, intercept, slope = solve(high, units, steps=CURVE_TRACES)
    return BatchEstimate(
        batch_size=units * multiple_of,
        capacity_bytes=capacity_bytes,
        peak_bytes=int(intercept + slope * units) if units else None,
        include_resident=include_resident,
        intercept_bytes=intercept,
        slope_bytes_per_sample=slope / multiple_of,
        device=str(step.device),
        estimates=[traced[u] for u in sorted(traced)],
    )


@checks.keywords(ESTIMATE_ALIASES, synonyms={"memory_limit": "capacity"})  # find_max_batch's name for the budget
def estimate_max_batch(
    step: TrainStep,
    capacity: int | str,
    *,
    include_resident: bool = True,
    max_batch: int | None = None,
    multiple_of: int = 1,
    steps: int = 2,
) -> BatchEstimate:
    """The largest batch (a multiple of ``multiple_of``, at most ``max_batch``) whose
    estimated peak fits ``capacity`` bytes (an int or ``"80GiB"``; ``memory_limit=``, as
    :func:`~autobatch.find_max_batch` names the budget, is taken as ``capacity``). Nothing runs for real.

    Works for any capacity on any machine: "what fits in 80 GiB?" is answered on a laptop.
    With ``include_resident=False`` the capacity is taken as the memory free *after* the model
    and optimizer state are loaded (the semantics of a :func:`~autobatch.simulated_memory`
    budget). Raises :class:`EstimateError` when the step cannot be traced, or when its memory
    does not grow with the batch and no ``max_batch`` bounds it.
    """
    capacity_bytes = parse_bytes(capacity, name="capacity")
    traced, peak, max_batch, multiple_of = _tracer(step, multiple_of=multiple_of, max_batch=max_batch, steps=steps,
                                                   include_resident=include_resident)
    max_units = max_batch // multiple_of if max_batch is not None else None

    def result(units: int, intercept: float = 0.0, slope: float = 0.0) -> BatchEstimate:
        ordered = [traced[u] for u in sorted(traced)]
        estimate = BatchEstimate(
            batch_size=units * multiple_of,
            capacity_bytes=capacity_bytes,
            peak_bytes=peak(units) if units else None,
            include_resident=include_resident,
            intercept_bytes=intercept,
            slope_bytes_per_sample=slope / multiple_of,
            device=str(step.device),
            estimates=ordered,
        )
        if estimate.held_growth_note:  # a leak: the answer holds for the traced steps only
            log.warning("%s", estimate.held_growth_note)
        return estimate

    first = _smallest_traced(peak, max_units)
    if peak(first) > capacity_bytes:
        return result(0)
    # bracket: grow x8 from the smallest size (small batches are dominated by fixed costs such
    # as the optimizer step, so a line through them says little about large ones)
    lo, hi = first, None
    while max_units is None or lo < max_units:
        units = lo * GROWTH if max_units is None else min(lo * GROWTH, max_units)
        if peak(units) > capacity_bytes:
            hi = units
            break
        if units * multiple_of >= SEARCH_CEILING:
            raise EstimateError(
                f"the estimated peak stays under the capacity up to {units * multiple_of} samples (the search "
                "ceiling, autobatch.probe.SEARCH_CEILING); give max_batch"
            )
        if peak(units) <= peak(first) and units >= GROWTH**6:
            raise EstimateError(
                f"estimated peak does not grow with the batch ({format_bytes(peak(first))} at {first * multiple_of}, "
                f"{format_bytes(peak(units))} at {units * multiple_of}); give max_batch"
            )
        lo = units
    # close: solve the line through the bracket's ends and trace the guess and its neighbour
    # across the boundary (two traces when the curve is straight there); bisect when a round
    # did not halve the bracket
    def fits(units: int) -> bool:
        return peak(units) <= capacity_bytes

    for _ in range(MAX_REFINE):
        if hi is None or hi - lo <= 1:
            break
        width = hi - lo
        slope = (peak(hi) - peak(lo)) / width
        guess = lo + math.floor((capacity_bytes - peak(lo)) / slope) if slope > 0 else (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)
        if fits(guess):
            lo, neighbour = guess, guess + 1
        else:
            hi, neighbour = guess, guess - 1
        if lo < neighbour < hi:
            lo, hi = (neighbour, hi) if fits(neighbour) else (lo, neighbour)
        if (hi - lo) * 2 > width and hi - lo > 1:
            middle = (lo + hi) // 2
            lo, hi = (middle, hi) if fits(middle) else (lo, middle)
    intercept, slope = _line(traced, lo, include_resident)
    log.info("estimated max batch %d for %s (peak %s of %s)", lo * multiple_of, step, format_bytes(peak(lo)),
             format_bytes(capacity_bytes))
    return result(lo, intercept, slope)


def _line(traced: dict[int, MemoryEstimate], near: int, include_resident: bool) -> tuple[float, float]:
    """Intercept and slope (per unit) through the two traced sizes nearest ``near``."""
    def bytes_of(units: int) -> int:
        return traced[units].counted(include_resident)

    ordered = sorted(sorted(traced, key=lambda u: abs(u - near))[:2])
    if len(ordered) < 2:
        return float(bytes_of(ordered[0])), 0.0
    u0, u1 = ordered
    slope = (bytes_of(u1) - bytes_of(u0)) / (u1 - u0)
    return bytes_of(u0) - slope * u0, slope
