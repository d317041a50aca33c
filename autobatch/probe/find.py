"""find_max_batch: the largest batch size whose real training step fits in memory.

The call reads as its pipeline: check the arguments (:mod:`~autobatch.probe.arguments`),
resolve the device and its cap, look the answer up in the probe cache
(:mod:`~autobatch.probe.caching.cache`), otherwise run trials (:mod:`~autobatch.probe.searching.search`) with
the model's state put back afterwards (:mod:`~autobatch.probe.snapshot.restore`), and agree every
figure with the other ranks of a distributed job (:mod:`~autobatch.probe.ranks`).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..memory.devices import SimulatedDeviceMemory, check_limit_in_simulation, memory_for, resolve_device
from ..memory.diagnostics import memory_diagnostics
from ..memory.host_room import check_host_room
from ..memory.units import parse_bytes
from . import arguments, ranks
from .. import checks
from .arguments import FIND_ALIASES, STRATEGY_NAMES, validate_places, validate_probe_args, validate_step
from .batch_growth import check_batch_grows
from .caching.cache import ProbeCache, key_components, key_of
from .caching.cache_hits import held_beside
from .tracing.estimated import estimate_only, place_first_trial
from .fresh_layout import FreshLayout
from .content_peaks import content_note, shapes_note, sparse_momentum_note, sparse_note
from .snapshot.unrestored import trained_for_real_note, warn_unrestored_optimizers, with_found_schedulers
from .held_growth import HeldGrowth, held_growth_note, left_out_notes
from ..memory.lazy_state import LazyStateWatch
from .snapshot.restore import Snapshot
from .snapshot.rng import step_generators
from .snapshot.failed_grads import FailedStepGrads, after_oom
from .snapshot.restore_places import unskipped
from .snapshot.written_modules import OutsideWrites
from .result import ProbeResult
from .searching.search import peak_limit, run_search
from .autotune import Autotune
from .caught import caught_note
from .recompiles import RecompileWatch
from .peak_guard import peak_guard_for
from .promise import (forget_own_layout, laid_out_note, park_created_state, promise_note, relayout_created_state,
                      release_after_probe)
from .train_step import TrainStep
from .pinned_state import PinnedState
from .trial import TrialRunner

__all__ = ["find_max_batch", "STRATEGY_NAMES"]

log = logging.getLogger("autobatch")


@checks.keywords(FIND_ALIASES)
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
    restore: tuple[Any, ...] | None = None,
    device: str | torch.device | None = None,
    cache: bool | str | os.PathLike | None = None,
    cache_key: object = None,
    estimate_first: bool | None = None,
    hand_loop: bool | None = None,
) -> ProbeResult:
    """Find the largest batch size for which ``fn(batch_size)`` runs without running out of memory.

    ``fn`` performs one real unit of work at the given batch size; for training, forward,
    backward and an optimizer step (a :class:`~autobatch.TrainStep` does exactly that). Every
    trial up to the first that passes, and the answer's, call it ``steps_per_trial`` times, so
    state created lazily on the first step (Adam's moments) is inside the measured peak; the
    other trials call it ``search_steps`` times.

    Args:
        start: first size tried (default 1; for ``predict`` and ``auto``, 8 rounded down to a
            multiple of ``multiple_of``; for ``halving``, ``max_batch`` or 1024).
        max_batch: the largest size worth trying; the search never goes above it.
        strategy: ``auto`` (the default: ``predict``, handing over to ``binary`` where the
            memory curve cannot be fitted; see ``estimate_first``), ``estimate`` (no trial: the
            largest batch whose fake-tensor-traced peak fits; ``result.tested`` is False),
            ``predict`` (fit peak memory against batch size, jump to the predicted boundary,
            close the gap), ``binary`` (double, then bisect), ``power`` (largest power-of-two
            multiple of ``start``), ``halving`` (halve from a high start). ``auto``,
            ``predict`` and ``binary`` return the exact boundary.
        margin: fraction taken off the boundary at the end, e.g. 0.05; the reduced size is
            verified with one more trial.
        multiple_of: the result (and every size tried) is a multiple of this.
        steps_per_trial: calls of ``fn`` in a full trial (>= 1; default 3). The returned size
            has always passed a full trial (on an accelerator, one run after the last trial
            that ran out of memory), and so has the first passing trial, where lazy state is made.
            On an accelerator a trial passes only if its allocated peak also stays
            ``ALLOCATOR_HEADROOM`` (1 %, :mod:`autobatch.probe.arguments`) under the capacity.
        search_steps: calls of ``fn`` in the other trials (default 1; None: every trial is
            full). They only tell which side of the boundary a size lies on; a trial whose
            size could be the answer (the next size up already failed), or that the line
            tries below the allocator's wall (where a first step proves little), runs full.
        memory_limit: cap the probe at this many bytes (int or "16GiB"): on CUDA with
            ``set_per_process_memory_fraction`` (the previous cap restored), on the CPU under
            :func:`~autobatch.simulated_memory` (without it, an active ``simulated_memory``
            context, else a safe default budget, noted in the result).
        restore: ``(model, optimizer)`` to put back bit-exactly after probing; implied when
            ``fn`` is a ``TrainStep``. Further items, ``(model, optimizer, scheduler)``, have
            ``state_dict()`` and ``load_state_dict()`` (an LR scheduler a plain callable steps, a
            ``GradScaler``): their state dicts are copied to host memory and loaded back after.
        device: where ``fn`` runs; default the ``TrainStep``'s model device, else the current
            accelerator, else the CPU.
        cache: the persistent probe cache (see :mod:`autobatch.cache`): ``True``, ``False``,
            or a directory. Default: on for a ``TrainStep``, and for a plain callable given a
            ``cache_key``. A hit skips the probe (``result.cached`` is True).
        cache_key: what identifies a plain callable's work (a string or JSON-able data);
            required to cache one, added to the derived key for a ``TrainStep``.
        estimate_first: ``auto`` on a ``TrainStep`` with no ``start`` places its first trial just below
            the boundary estimated with fake tensors (not where a trace costs more than 2 trials: ``trace_cost``).
            Default: on for the CPU's simulated device, off on accelerators (tracing a real model took longer there).
        hand_loop: whether a loop that cannot replay a step that runs out of memory trains the
            answer (your own, Lightning's, the Transformers ``Trainer``'s): its trial must then
            stop flushing the allocator's cache, at which a run resumed from a checkpoint ran out of
            memory (``docs/promise.md``; not every resumed layout is covered). Default: True for a
            plain callable and a ``torch.compile``'d ``TrainStep`` (notes say why), else False.

    Raises:
        ValueError, TypeError: a bad argument (the message names it and what it accepts).
        NoBatchFitsError: even the smallest allowed batch ran out of memory. EstimateError:
            ``strategy="estimate"`` where no estimate stands (the peak stays under the capacity
            up to the search ceiling: give ``max_batch``; a step the trace cannot follow).
    """
    validate_step(fn, strategy)
    validate_places(device, restore, cache, step=fn)
    given = validate_probe_args(start=start, max_batch=max_batch, strategy=strategy, margin=margin, multiple_of=multiple_of,
                                steps_per_trial=steps_per_trial, search_steps=search_steps, estimate_first=estimate_first)
    hand_loop, loop_notes = arguments.hand_loop_of(fn, hand_loop)
    # a make_batch that ignores its size is an error, not a climb to the search ceiling
    batches = arguments.checked_batches(fn) if isinstance(fn, TrainStep) else None
    limit_bytes = None if memory_limit is None else parse_bytes(memory_limit, name="memory_limit")
    agreement = _agreement(probe_args := {"strategy": strategy, **given, "hand_loop": hand_loop}, estimate_first)
    fn = agreement.local_step(fn)  # DDP: the real DDP step, collectives guarded (autobatch.dist.probe)
    if isinstance(fn, TrainStep):  # its model's device; its model and optimizer, restored
        device, restore = device if device is not None else fn.device, restore or (fn.model, fn.optimizer)
    call = _Call(
        fn=fn, target=resolve_device(device), limit_bytes=limit_bytes, agreement=agreement,
        began=time.perf_counter(), steps_per_trial=given["steps_per_trial"], hand_loop=hand_loop, batches=batches,
        notes=loop_notes + arguments.eval_mode_notes(fn), probe_args=probe_args,
    )
    if strategy == "estimate":
        return _estimate(call)
    hit = _cache_lookup(call, cache, cache_key, restore) if cache is not False else None
    return hit if hit is not None else _finish(call, _probe(call, restore, estimate_first))


def _agreement(probe_args: dict[str, Any], estimate_first: bool | None) -> ranks.ProbeAgreement:
    """How this probe agrees with the other ranks of a job, once they agreed that they run the same
    search (distributed: one sync point; arguments that differ are one ``ValueError`` naming them)."""
    agreement = ranks.current()
    agreement.arguments({**probe_args, "estimate_first": estimate_first})
    return agreement


@dataclass
class _Call:
    """One ``find_max_batch`` call's settled inputs and the cache entry it may write."""

    fn: Any
    target: torch.device
    limit_bytes: int | None
    agreement: ranks.ProbeAgreement
    began: float
    steps_per_trial: int
    hand_loop: bool
    probe_args: dict[str, Any]
    batches: Any = None  # a TrainStep's make_batch(1) and make_batch(2), for the cache key
    store: ProbeCache | None = None
    key: str | None = None
    components: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def _probe(call: _Call, restore, estimate_first: bool | None) -> ProbeResult:
    """Run the trials on the device (capped), the model's state restored afterwards."""
    fn, args = call.fn, call.probe_args
    check_limit_in_simulation(call.target, call.limit_bytes)  # a memory_limit no answer here could be: before the copy
    check_host_room(call.target, call.limit_bytes, args["max_batch"])  # a CPU budget past the host's RAM
    snapshot, restore = None, with_found_schedulers(fn, restore, call.notes)  # a scheduler the callable steps
    outside = OutsideWrites.of(fn, restore)  # an EMA teacher restore lacks: its versions, told after
    if restore is not None:
        snapshot = _snapshot(fn, restore)
        # no trial's optimizer step skipped for a scaled gradient that overflowed: it makes the state
        unskipped([fn.grad_scaler if isinstance(fn, TrainStep) else None, *restore[2:]])
    # a plain callable's: the gradients a failed trial began with are made again (failed_grads)
    grads = None if snapshot is None or isinstance(fn, TrainStep) else FailedStepGrads(restore, snapshot.undo_forward)
    prior = result = None
    recompiles = RecompileWatch(_trained_model(fn, restore), simulated=call.target.type == "cpu")  # compiled trials
    autotune = Autotune(call.target)
    watch = LazyStateWatch()
    try:
        with memory_for(call.target, call.limit_bytes) as (memory, note):
            capacity = call.agreement.capacity(memory.capacity())
            simulated = isinstance(memory, SimulatedDeviceMemory)
            call.notes += arguments.simulated_compile_note(_trained_model(fn, restore)) if simulated else []
            agree, limit = call.agreement.trial_hook(), peak_limit(memory, capacity)
            kept = HeldGrowth(fn, memory)  # what the step keeps from call to call (a list of its outputs)
            runner = TrialRunner(
                kept, memory, call.steps_per_trial,
                after_oom=after_oom(fn.clear_grads if isinstance(fn, TrainStep) else None, grads, watch),
                agree=agree, search_steps=args["search_steps"],
                peak_limit=limit, autotune=autotune, settle_final=not simulated,
                settle_more=lambda more: call.agreement.settle_more(fn, more),
                guard=peak_guard_for(_trained_model(fn, restore), memory.peak, limit, agreed=agree is not None),
                # a hand loop's settle trials run beside state laid out as a resumed run has it; a
                # TrainStep's (its Runner replays) may drop state made at a nearby size
                pinned=None if call.hand_loop else PinnedState(watch), hand_loop=call.hand_loop,
                layout=(lambda: relayout_created_state(watch, call.target)) if call.hand_loop else None,
                before_trial=grads.before_trial if grads else snapshot and snapshot.undo_forward,  # what forward kept
                held_growth=lambda: watch.growth_from_now(call.target),
            )
            kept.trials = runner.records.__len__  # the running trial's index (no cycle holding fn past the probe)
            if estimate_first is None:
                # measured (docs, benchmarks): on the CPU's simulated device tracing is cheap
                # and exact; on a GPU the traces of a real model cost seconds, more than the
                # trials they save, so auto starts from its fit there unless asked otherwise
                estimate_first = isinstance(memory, SimulatedDeviceMemory)
            estimate_note = None  # why the estimate could not trace the step, where it ran
            if args["strategy"] == "auto" and args["start"] is None and isinstance(fn, TrainStep) and estimate_first:
                prior, estimate_note = place_first_trial(fn, runner, memory, capacity, args, call.agreement, snapshot)
                call.notes.append(estimate_note)
            result = run_search(
                runner, strategy=args["strategy"], start=args["start"], max_batch=args["max_batch"],
                margin=args["margin"], multiple_of=args["multiple_of"], device_name=memory.name,
                capacity=capacity, prior=prior, confirm=not simulated, hand_loop=call.hand_loop,
                # training from scratch makes its state in its first step (fresh_layout.py: when that is checked)
                fresh_layout=FreshLayout(lambda: (watch.drop_created(), memory.release_cached()), memory,
                                         always=call.hand_loop and isinstance(fn, TrainStep),
                                         agree=lambda v: call.agreement.any_rank(v, "probe: check in a new process's layout")),
            )
            if isinstance(fn, TrainStep) and result.smallest_failed is None:  # no OOM bounded it: a batch that grew?
                check_batch_grows(fn.make_batch, result.largest_passed, "the answer")
            result.diagnostics = memory_diagnostics(memory)
            call.notes.append(promise_note(runner, result, memory))
            call.notes.append(held_growth_note(kept, runner.records, result.batch_size, capacity if limit is None else limit))
            call.notes.append(content_note(kept.steps, runner.records, result.batch_size)  # padded to its longest
                              or sparse_note(fn, restore, result.batch_size)  # sparse gradients
                              or shapes_note(estimate_note, result.batch_size))  # routed by value (MoE)
            call.notes += [arguments.gradless_note(fn), sparse_momentum_note(fn, restore), *left_out_notes(fn, kept, watch)]
            call.notes.append(caught_note(runner.records))  # errors the step caught itself (caught.py)
            call.notes.append(recompiles.note())  # near dynamo's recompile limit (dynamic=False: a graph per size)
    except Exception as exc:
        recompiles.explain(exc)  # fullgraph=True past the recompile limit: what the trials had to do with it
        call.agreement.left(fn, exc)  # other ranks: told at once, not left waiting for this one
        raise
    finally:
        autotune.restore()
        watch.close()
        if snapshot is not None:
            snapshot.restore()
        warn_unrestored_optimizers(watch.stepped(), restore)  # a GAN's other optimizer, stepped and not put back
        outside.warn(watch.stepped())
        call.notes.append(trained_for_real_note(watch.stepped(), restore))
        # return the blocks the trials split (OOM trials above all) and lay the state the trials
        # created out as a hand loop's settle trials had it: training here starts where the answer
        # passed (without a hand loop, where a new run makes it: parked until the next step)
        release_after_probe(call.target, workspaces=call.hand_loop)
        laid_out = 0
        if result is not None:
            laid_out = (relayout_created_state if call.hand_loop else park_created_state)(watch, call.target)
        if laid_out and call.hand_loop:
            release_after_probe(call.target)  # what the layout's private pool held
    if laid_out:
        result.promise = None if result.promise is None else {**result.promise, "laid_out_state_bytes": laid_out}
        call.notes.append(laid_out_note(laid_out, parked=not call.hand_loop))
    if prior is not None:
        result.estimate = prior[1].to_dict()
    if note:
        call.notes.append(note)
    return result


def _snapshot(fn, restore: tuple[Any, ...]) -> Snapshot:
    """The snapshot of ``restore``. A ``TrainStep`` changes its weights only in its optimizer's
    step: they are copied meanwhile, or, where a step at learning rate 0 leaves them exact, not at
    all. A further module in ``restore`` (a GAN's discriminator) is put back as the model is
    (weights, buffers, gradients, train/eval flags, what forward registered), not only by its state
    dict, and so are the weights a further optimizer trains outside the modules: both are copied
    before the trials, as another optimizer may step first."""
    modules = [item for item in restore[2:] if isinstance(item, torch.nn.Module)]
    more = bool(modules) or any(isinstance(item, torch.optim.Optimizer) for item in restore[2:])
    own = isinstance(fn, TrainStep) and fn.optimizer is restore[1] and not more
    model = torch.nn.ModuleList([restore[0], *modules]) if modules else restore[0]
    held = {id(param) for param in model.parameters()}
    loose = [k for k, item in enumerate(restore[2:], start=2) if isinstance(item, torch.optim.Optimizer)
             and any(id(p) not in held for group in item.param_groups for p in group["params"])]
    if loose:
        warnings.warn(
            f"restore[{loose[0]}] trains parameters that no module in restore holds: the probe puts their values and "
            "the optimizer's state back, but not the buffers of the module they belong to (BatchNorm's running "
            "statistics); pass that module in restore too, as (model, optimizer, other_model, other_optimizer)",
            RuntimeWarning, stacklevel=4,
        )
    others = tuple(item for item in restore[2:] if not isinstance(item, torch.nn.Module))
    return Snapshot.take(model, restore[1], background=own, zero_lr=own, others=others,
                         scaler=fn.grad_scaler if isinstance(fn, TrainStep) else None,
                         generators=tuple(step_generators(fn, restore)))  # a make_batch's seeded generator


def _trained_model(fn, restore) -> torch.nn.Module | None:
    """The model ``fn`` trains, where known: a ``TrainStep``'s, or the one given as ``restore``."""
    if isinstance(fn, TrainStep):
        return fn.model
    return restore[0] if restore is not None else None


def _finish(call: _Call, result: ProbeResult) -> ProbeResult:
    """Stamp the call's figures and notes on the result, agree it, cache it, log it."""
    result.notes.extend(n for n in call.notes if n)
    result.elapsed_s = time.perf_counter() - call.began
    result.memory_limit_bytes = call.limit_bytes
    result.steps_per_trial = call.steps_per_trial
    result = call.agreement.batch(result)
    if call.store is not None and not call.agreement.active():
        # agreed trials describe the weakest rank, not this device: ranks read the cache, never write it
        call.store.put(call.key, call.components, result)
    log.info(
        "probe found batch %d with %s in %d trials (%.2fs)",
        result.batch_size, result.strategy_used, result.num_trials, result.elapsed_s,
    )
    return result


def _estimate(call: _Call) -> ProbeResult:
    """``strategy="estimate"``: no trial; the estimate, agreed over the ranks."""
    args = call.probe_args
    with memory_for(call.target, call.limit_bytes) as (memory, note):
        result = estimate_only(
            call.fn, memory, note, max_batch=args["max_batch"], margin=args["margin"], multiple_of=args["multiple_of"]
        )
        result.diagnostics = memory_diagnostics(memory)
    result.elapsed_s = time.perf_counter() - call.began
    result.memory_limit_bytes = call.limit_bytes
    result.steps_per_trial = call.steps_per_trial
    log.info("estimated batch %d (untested) in %.2fs", result.batch_size, result.elapsed_s)
    return call.agreement.batch(result)


def _cache_lookup(call: _Call, cache, cache_key, restore=None) -> ProbeResult | None:
    """The cached answer (agreed over the ranks) or None; sets where a fresh answer is stored."""
    fn = call.fn
    if cache is None and not isinstance(fn, TrainStep) and cache_key is None:
        return None  # default: plain callables are not cached
    if not isinstance(fn, TrainStep) and cache_key is None:
        call.notes.append("not cached: a plain callable is cached only under an explicit cache_key")
        return None
    with memory_for(call.target, call.limit_bytes) as (memory, _):
        device_name, capacity, allocated = memory.name, memory.capacity(), memory.allocated()
    try:
        components = key_components(
            fn, cache_key=cache_key, restore=restore, device=device_name, capacity=capacity, memory_limit=call.limit_bytes,
            # the headroom decides which trials pass on an accelerator: answers found under
            # another headroom (older versions had none) are not this probe's answers
            probe={**call.probe_args, "allocator_headroom": arguments.ALLOCATOR_HEADROOM,
                   "expandable_headroom_bytes": arguments.EXPANDABLE_HEADROOM_BYTES},
            batches=call.batches,
        )
    except Exception as exc:  # noqa: BLE001 - a key we cannot derive only costs the cache
        log.warning("probe cache off for this call: could not derive the key (%s: %s)", type(exc).__name__, exc)
        call.notes.append(f"not cached: could not derive the cache key ({type(exc).__name__}: {exc})")
        return None
    call.store = ProbeCache(None if cache in (None, True) else cache)
    call.key, call.components = key_of(components), components
    found = call.store.get(call.key)
    headroom = 0.0 if call.target.type == "cpu" else arguments.ALLOCATOR_HEADROOM  # what its passing trials kept free
    if found is not None and (why := held_beside(found, allocated, capacity, headroom)):
        call.notes.append(why)  # memory held beside the step now: the cached answer is an emptier device's
        found, call.store = None, None  # and this fuller device's answer does not replace it
    hit = call.agreement.cache_hit(found)
    if hit is None:
        return None
    forget_own_layout(hit)
    hit.elapsed_s = time.perf_counter() - call.began
    log.info("probe cache hit: batch %d (%s)", hit.batch_size, call.store.path_of(call.key))
    return call.agreement.batch(hit)
