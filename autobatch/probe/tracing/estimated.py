"""The probe's use of estimates: ``auto``'s first trial placed by an estimate, and
``strategy="estimate"``'s untested answer (the estimates themselves: :mod:`~autobatch.probe.tracing.estimate`)."""

from __future__ import annotations

import math
import time

import torch

from ...errors import NoBatchFitsError
from ...memory.devices import SimulatedDeviceMemory
from ...memory.units import format_bytes
from ..arguments import PREDICT_DEFAULT_START, SEARCH_CEILING, compiled_model
from ..batch_growth import check_batch_grows
from .estimate import TRIALS, EstimateError, estimate_line, estimate_max_batch
from ..searching.line import LinearFit
from ..result import ProbeResult
from .trace_failures import from_the_step, untraceable
from ..train_step import TrainStep
from .trace_budget import OP_GROWTH
from .trace_cost import TraceCost

__all__ = ["estimate_prior", "estimate_only", "compiled_note", "place_first_trial"]


def counts_resident(memory) -> tuple[bool, str | None]:
    """Whether the model's resident memory counts against the capacity (and a note why not):
    on an accelerator it does; a simulated CPU budget counts only what the step allocates."""
    if isinstance(memory, SimulatedDeviceMemory):
        return False, "the simulated CPU budget counts only memory the step allocates, not the model"
    return True, None


def place_first_trial(step: TrainStep, runner, memory, capacity: int, args: dict, agreement, snapshot):
    """``auto``'s first trial placed by an estimate (find.py): ``(prior, note)``, the prior agreed over
    the ranks. Its first trace is weighed against the search's own first trial (:mod:`~autobatch.probe.tracing.trace_cost`),
    except in a distributed job, where a trial only some ranks chose to run would leave the others waiting."""
    if snapshot is not None:
        snapshot.wait()  # the trace swaps fake tensors into the model: copy before it
    max_batch, multiple_of = args["max_batch"], args["multiple_of"]

    def first_trial() -> tuple[int, float | None]:  # the trial predict starts from without an estimate
        size = max(multiple_of, PREDICT_DEFAULT_START // multiple_of * multiple_of)
        if max_batch is not None:
            size = min(size, max(multiple_of, max_batch // multiple_of * multiple_of))
        final = max_batch is not None and size >= max_batch // multiple_of * multiple_of
        record = runner.passed_record(size) if runner(size, "fit", final=final) else None
        return size, None if record is None else record.seconds

    cost = None if agreement.active() else TraceCost(first_trial)
    prior, note = estimate_prior(step, memory, capacity, max_batch, multiple_of, cost=cost)
    prior = agreement.prior(prior)
    if prior is not None:  # an error at that first trial says where its size came from
        runner.first_placed = (f"placed just below the boundary a fake-tensor trace estimated, "
                               f"{prior[1].batch_size}; estimate_first=False starts the search small")
    return prior, note


def estimate_prior(step: TrainStep, memory, capacity: int, max_batch: int | None, multiple_of: int,
                   cost: TraceCost | None = None):
    """The estimated curve in units of ``multiple_of`` for ``auto``'s first trial, and a note;
    ``(None, note)`` when the step cannot be estimated (``cost``: :mod:`~autobatch.probe.tracing.trace_cost`)."""
    include_resident, _ = counts_resident(memory)
    began = time.perf_counter()
    try:
        estimate = estimate_line(
            step, capacity, include_resident=include_resident, max_batch=max_batch, multiple_of=multiple_of,
            op_growth=OP_GROWTH, cost=cost,  # a trace whose operators grow with the batch costs more than trials
        )
    except Exception as exc:  # noqa: BLE001 - the estimate's, or the step's own error (its trials raise it for real)
        if not isinstance(exc, EstimateError) and not from_the_step(exc):
            raise
        why = str(exc).replace(f"; {TRIALS}", "") if isinstance(exc, EstimateError) else untraceable(exc)
        return None, f"no estimate for the first trial ({why}); probed from the start"
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


def estimate_only(step: TrainStep, memory, note, *, max_batch, margin, multiple_of) -> ProbeResult:
    """``strategy="estimate"``: the estimated boundary, no trials, marked untested."""
    capacity = memory.capacity()
    include_resident, why = counts_resident(memory)
    try:
        estimate = estimate_max_batch(
            step, capacity, include_resident=include_resident, max_batch=max_batch, multiple_of=multiple_of
        )
    except EstimateError:  # its peak stayed under the capacity: a make_batch that stopped growing says why
        check_batch_grows(step.make_batch, max_batch or SEARCH_CEILING // multiple_of * multiple_of, "the estimate's bound")
        raise
    if max_batch is not None and estimate.batch_size == max_batch // multiple_of * multiple_of:
        check_batch_grows(step.make_batch, estimate.batch_size, "the estimate")  # bounded by max_batch, not memory
    if estimate.batch_size == 0:
        smallest = estimate.estimates[0]
        raise NoBatchFitsError(
            batch_size=smallest.batch_size,
            capacity_bytes=capacity,
            peak_bytes=smallest.counted(include_resident),
            device=memory.name,
            estimated=True,
        )
    chosen = estimate.batch_size
    if margin:
        chosen = max(multiple_of, math.floor(chosen * (1 - margin)) // multiple_of * multiple_of)
    notes = [f"untested estimate: traced with fake tensors, no trial ran (peak {format_bytes(estimate.peak_bytes)})"]
    notes += [told for told in (why, compiled_note(step.model), estimate.held_growth_note) if told]
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


def compiled_note(model: torch.nn.Module) -> str | None:
    """A note where the model or a module of it is compiled (:func:`~autobatch.probe.arguments.compiled_model`):
    PyTorch's compiler does not compile under the trace's dispatch modes ("non-infra torch dispatch
    mode present"), so the trace ran the uncompiled code, whose activations a compiled graph
    (fused kernels) may not keep. None otherwise."""
    if not compiled_model(model):
        return None
    return ("the model is compiled (torch.compile), which does not compile under the fake-tensor trace: the estimate "
            "is of its uncompiled code, whose peak the compiled graph's may differ from (it typically keeps fewer "
            "activations); on an accelerator, probe with trials (strategy='binary' or 'auto') to measure the "
            "compiled step")
