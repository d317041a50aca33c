"""Why a probed answer is safe, in figures: what the answer's confirming trial measured.

An answer is a promise that training runs at it, in the process that probed and in a new one
(a cache hit). What stands behind it, recorded in ``ProbeResult.promise`` and a note:

* the answer passed a full trial (on an accelerator: after the last OOM trial, from an emptied
  cache, with cuDNN autotuning as the user set it, and for more steps while the allocator's
  reserved peak still grew or, with autotuning, expandable segments or a plain callable (a hand
  loop), while its steps still flushed the allocator's cache: :meth:`~autobatch.probe.trial.TrialRunner.run` ``settle``,
  :mod:`~autobatch.probe.settling`); with autotuning the confirmation tuned for real, and its
  plans stay cached for training in this process (:mod:`~autobatch.probe.autotune`);
* its allocated peak left the allocator's headroom free (1 % of the capacity, or two 20 MiB
  pages with expandable segments under a cap: :func:`~autobatch.probe.searching.search.allocator_headroom`),
  and its steady steps cleared the allocator's wall: the allocated peak plus the bytes the
  trial left in split blocks the allocator cannot return stayed under the capacity
  (:meth:`~autobatch.probe.trial.TrialRunner._wall_excess`); what the
  allocator did on top of it (reserved − allocated at the peak, inactive split blocks) is
  measured and shown;
* after the probe the cache is emptied (:func:`release_after_probe`) and the optimizer state a
  hand loop's trials created is laid out as loading a checkpoint places it, the layout its
  settle trials passed in (:func:`relayout_created_state`, :mod:`~autobatch.memory.parking`), so
  training in the same process starts where the answer was confirmed, not among blocks split by
  OOM trials or beside state made at a smaller size;
* whether ``expandable_segments`` was on (it changes the answer; the answer holds for the
  setting it was found under).
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory.devices import DeviceMemory
from ..memory.lazy_state import LazyStateWatch
from ..memory.allocator import expandable_segments_on
from ..memory.parking import park_until_step, relayout_as_loaded
from ..memory.workspaces import release_workspaces
from ..memory.units import format_bytes
from .result import STORED_NOTE, ProbeResult
from .trial import TrialRunner

__all__ = ["forget_own_layout", "park_created_state", "relayout_created_state", "laid_out_note", "promise_of", "promise_note", "release_after_probe",
           "still_flushing", "at_fixed_wall", "near_fixed_wall"]


def promise_of(runner: TrialRunner, result: ProbeResult, memory: DeviceMemory) -> dict[str, Any] | None:
    """The figures behind ``result.batch_size``: its latest passing trial's measurements, a trial
    in the trials' own layout before one in a new process's (:mod:`~autobatch.probe.fresh_layout`:
    that check runs untuned, and the answer's confirmation is what autotuned)."""
    record = next((r for r in reversed(runner.records) if r.batch_size == result.batch_size and r.passed
                   and r.purpose != "fresh"), None) or runner.passed_record(result.batch_size)
    if record is None:
        return None
    last_oom = max((i for i, r in enumerate(runner.records) if runner.ran_out(r)), default=-1)
    index = max(i for i, r in enumerate(runner.records) if r is record)
    capacity = result.capacity_bytes
    return {
        "batch_size": record.batch_size,
        "steps": record.steps,
        "after_last_oom": index > last_oom,
        "autotuned": record.autotuned,
        "step_peak_bytes": record.step_peak_bytes,
        "reserved_peak_bytes": record.reserved_bytes,
        "fragmentation_bytes": record.fragmentation_bytes,
        "inactive_split_bytes": record.inactive_split_bytes,
        "flushes": record.flushes,
        "capacity_bytes": capacity,
        "peak_fraction": None if not capacity or record.step_peak_bytes is None else record.step_peak_bytes / capacity,
        # what a passing trial's allocated peak had to leave free (search.allocator_headroom)
        "allocator_headroom_bytes": None if runner.peak_limit is None or not capacity else capacity - runner.peak_limit,
        "expandable_segments": expandable_segments_on(getattr(memory, "device", None)),
    }


def promise_note(runner: TrialRunner, result: ProbeResult, memory: DeviceMemory) -> str:
    """Store :func:`promise_of` on ``result`` and say it in one line (on an accelerator; the
    simulated device has no allocator whose behaviour needs explaining, so no note there)."""
    promise = result.promise = promise_of(runner, result, memory)
    if promise is None or runner.peak_limit is None:
        return ""
    parts = [f"why {promise['batch_size']} is safe: it passed {promise['steps']} full steps"]
    if promise["after_last_oom"] and runner.settle_final:
        parts.append("after the last OOM trial, from an emptied cache")
    if promise["autotuned"]:
        parts.append("with cuDNN autotuning on, tuned for real as training will be (its plans stay cached for "
                     "training in this process), its last step no longer flushing the allocator's cache")
    if promise["peak_fraction"] is not None:
        parts.append(f"peak {format_bytes(promise['step_peak_bytes'])} allocated = {100 * promise['peak_fraction']:.1f} % of capacity")
    if runner.peak_limit is not None:
        parts.append(
            f"{format_bytes(promise['reserved_peak_bytes'])} reserved, {format_bytes(promise['fragmentation_bytes'])} "
            f"reserved-but-unused at the peak, {format_bytes(promise['inactive_split_bytes'])} in inactive split blocks; "
            f"passing trials left {_headroom(promise)} free, and room at the allocator's wall (for the split "
            f"blocks their steady steps left, or under a reserved peak short of the capacity); expandable_segments "
            f"{'on' if promise['expandable_segments'] else 'off'}"
            + (", its last step not flushing the allocator's cache (a step that does is at the cap)"
               if promise["expandable_segments"] and promise.get("flushes") is not None and runner.settle_final else "")
        )
    if still_flushing(promise):
        parts.append(STILL_FLUSHING)
    if at_fixed_wall(promise):
        parts.append(f"{promise['flushes']} of its {promise['steps'] - 1} steps after the first {AT_FIXED_WALL}")
    elif getattr(runner, "hand_loop", False) and near_fixed_wall(promise):
        parts.append(f"its steps reserved {100 * promise['reserved_peak_bytes'] / promise['capacity_bytes']:.1f} % of "
                     f"the capacity: {NEAR_FIXED_WALL}")
    elif near_fixed_wall(promise):  # the Runner's answer: it replays, but the user should know why it may
        parts.append(f"its steps reserved {100 * promise['reserved_peak_bytes'] / promise['capacity_bytes']:.1f} % of "
                     f"the capacity, {format_bytes(promise['fragmentation_bytes'])} "
                     f"({100 * promise['fragmentation_bytes'] / promise['capacity_bytes']:.0f} %) of it unused at the "
                     f"peak: {FRAGMENTED_WALL}")
    if promise["autotuned"]:
        parts.append(NEW_PROCESS_AUTOTUNING)
    return "; ".join(parts)


def _headroom(promise: dict[str, Any]) -> str:
    """The headroom a passing trial left, in words: bytes, and the share of the capacity."""
    headroom, capacity = promise["allocator_headroom_bytes"], promise["capacity_bytes"]
    if headroom is None:
        return "the allocator's headroom"
    return f"{format_bytes(headroom)} ({100 * headroom / capacity:.2g} % of capacity)"


def still_flushing(promise: dict[str, Any]) -> bool:
    """Whether every step of the answer's trial after the first made the allocator flush its
    cache, with no autotuning (whose confirmation keeps stepping until flushing stops, and
    fails if it does not: :mod:`~autobatch.probe.settling`)."""
    flushes = promise.get("flushes")
    return not promise["autotuned"] and bool(flushes) and flushes >= promise["steps"] - 1


#: What an answer whose steps all flushed the allocator's cache means for a hand-written loop
#: (issue 16, measured on one H100 under an 8 GiB cap, ``scripts/diag_retries.py``: ResNet-50 as
#: a plain callable answered 180, whose trial flushed 2-4 times a step; in the probing process a
#: hand loop at 180 ran out of memory at step 14 in 3 of 3 runs while the trials' optimizer state
#: stayed where the trial at 8 had made it; parked and brought back at the loop's first step
#: the loop flushed for eight steps, then never, 200 steps in every run, as in a new process;
#: 179 trained flushing at every step, 178 stopped by step 7)
STILL_FLUSHING = (
    "every step after the first flushed the allocator's cache: this size sits at the allocator's wall, so the "
    "first training steps may flush too (each flush costs time), and memory a loop holds beyond what the step "
    "held here has no room; autobatch's Runner replays a step that runs out of memory in smaller micro-batches"
)


def at_fixed_wall(promise: dict[str, Any]) -> bool:
    """Whether at least two steps of the answer's trial after the first made the allocator
    flush its cache (not every one: :func:`still_flushing`), under fixed segments, untuned."""
    flushes = promise.get("flushes")
    return (not promise["autotuned"] and not promise["expandable_segments"] and bool(flushes) and flushes >= 2
            and not still_flushing(promise))


#: What an answer some of whose steps flushed under fixed segments means for a new process (issue
#: 16, measured on one H200 under an 8 GiB cap, ViT-B/32 as a plain callable: 376's trial flushed
#: in two of its three steps after the first and trained 200 steps in the probing process; a new
#: process that started training at it, cold, ran out of memory at step 3 from scratch and at step
#: 1 resumed, where 373 trained in both; under expandable segments its answer, 383, trained
#: everywhere: ``scripts/diag_fresh_layout.py --cold``)
AT_FIXED_WALL = (
    "flushed the allocator's cache: under fixed segments this size is at the allocator's wall, and a new process, "
    "whose blocks fall otherwise, can run out of memory a few sizes lower; PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True (set before CUDA starts; the command line's default) removes that wall, and "
    "autobatch's Runner replays a step that runs out of memory"
)


#: how close to the capacity an answer's reserved peak comes before :func:`near_fixed_wall` says so
NEAR_WALL = 0.02


def near_fixed_wall(promise: dict[str, Any]) -> bool:
    """Whether the answer's trial reserved within ``NEAR_WALL`` of the capacity under fixed
    segments, untuned, with no flushing note (:func:`at_fixed_wall`, :func:`still_flushing`)."""
    capacity, reserved = promise.get("capacity_bytes"), promise.get("reserved_peak_bytes")
    return (not promise["autotuned"] and promise["expandable_segments"] is False and bool(capacity) and bool(reserved)
            and reserved >= capacity * (1 - NEAR_WALL) and not at_fixed_wall(promise) and not still_flushing(promise))


#: What a hand loop's answer at the wall under fixed segments means for a new process, where its
#: trial did not flush (issue 16, measured on one H100 under an 8 GiB cap, Swin-S as a plain
#: callable: 66 passed its trial without a flush, reserving 98.7 % of the capacity, and trained
#: 200 steps in the probing process and resumed, but a new process ran out of memory at its
#: second step; under expandable segments the answer was 69, the 3-step maximum, and trained in
#: all three: ``scripts/bench_promise.py --no-cli --resumed --workloads swin_s``)
NEAR_FIXED_WALL = (
    "under fixed segments a hand loop at this size in a new process, whose blocks fall otherwise, can run out of "
    "memory a few sizes lower, with no sign in the trials (Swin-S on an H100: 66 passed without a flush and failed "
    "at a new process's second step); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts; "
    "the command line's default) removes that wall, and autobatch's Runner replays a step that runs out of memory"
)


#: What the Runner's answer (a ``TrainStep`` it replays) at the fixed wall (:func:`near_fixed_wall`) means
#: for a new process (issue 16, measured on one H200 under an 8 GiB cap, bf16, Wav2Vec2 trained with CTC on
#: 2 s of audio: the ``TrainStep`` answered 64, its trial reserving 99.9 % with 1.9 GiB unused at the
#: peak, its requests up to 800 MiB; in new processes the Runner at 64 and at 60 recovered once
#: (64 → 58, 60 → 57) where 62 and 58 trained 30 steps, and a hand loop failed 64 and 62 at step 7
#: where 60 trained: the wall there is no size but how the blocks fall. A check in a new process's
#: layout (:mod:`~autobatch.probe.fresh_layout`) answered 63, and the Runner at 63 recovered in 3 of 3
#: new processes. Under expandable segments every answer trained 100 steps with no recovery. Said from
#: 15 % of the capacity unused at the peak until a ViT-MAE's ``TrainStep``, with 7.3 % unused (0.6 GiB),
#: answered 109 reserving 99.5 %, and the Runner at 109 recovered at step 12 in the probing process and at
#: step 11 in a new one (109 -> 106), as at 106-110 in new processes, 105 training 40 steps; under
#: expandable segments it answered 117 and trained 200 steps in both with no recovery. A VAE's answer
#: with 9.4 % unused trained everywhere: no share of unused memory tells the two apart, so every Runner's
#: answer near the fixed wall says it)
FRAGMENTED_WALL = (
    "under fixed segments a step whose large blocks fit only as they happen to fall, and in a new process, whose "
    "blocks fall otherwise, autobatch's Runner may replay a step at this size in smaller micro-batches (no sample "
    "lost, at a few percent of speed); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts; "
    "the command line's default) removes that wall"
)


#: What a new process should know about cuDNN autotuning (issue 16, measured on one H200 under an
#: 8 GiB cap, ResNet-50 as a hand loop: a new process autotunes again at its first step; at the
#: probe's answers, 177 and (now) 178, 4 of 4 and 5 of 5 new processes trained 200 steps, where at
#: 180, a size whose steps flush the allocator's cache, 4 of 6 ran out of memory by step 25)
NEW_PROCESS_AUTOTUNING = (
    "in a new process cuDNN autotunes again at the first step; keep torch.backends.cudnn.benchmark on from "
    "that step (PyTorch keeps one plan per shape whatever the flag, so a first step run untuned keeps its "
    "untuned plans for good), and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True removes the allocator "
    "flushing that autotuned workspaces cause (autobatch's Runner replays a step that runs out of memory)"
)


def park_created_state(watch: LazyStateWatch, device: torch.device) -> int:
    """Park the optimizer state the trials created on ``device`` until each optimizer's next
    step (:func:`~autobatch.memory.parking.park_until_step`), where a new run makes it; the bytes
    parked. After the probe of a plain callable with ``hand_loop=False``, whose trials laid
    nothing out."""
    return sum(park_until_step(optimizer, tensors, device) for optimizer, tensors in watch.created_on(device))


def relayout_created_state(watch: LazyStateWatch, device: torch.device) -> int:
    """Lay the optimizer state the trials created on ``device`` out as a run resumed from a
    checkpoint has it, before its first step (:func:`~autobatch.memory.parking.relayout_as_loaded`);
    the bytes laid out. Before each settle trial of a hand loop, which cannot replay a step, and
    after its probe. Only a plain callable's state is left to lay out: a snapshot's restore drops
    what a ``TrainStep``'s trials created, and its first training step creates it again."""
    return sum(relayout_as_loaded(optimizer, tensors, device) for optimizer, tensors in watch.created_on(device))


#: how :func:`laid_out_note` begins (a cache hit drops the note: it laid nothing out)
LAID_OUT = "the optimizer state the trials created ("


def laid_out_note(laid_out: int, *, parked: bool = False) -> str:
    """The note for state :func:`relayout_created_state` laid out after the probe (``parked``:
    :func:`park_created_state` parked it)."""
    where = ("waits in a private memory pool until the optimizer's next step, which copies it back where a new run "
             "makes it" if parked else "was laid out as loading a checkpoint places it, in fresh memory before the next "
             "step's activations: the layout the answer's trials passed in")
    return (f"{LAID_OUT}{format_bytes(laid_out)}) {where} (state made at a smaller trial size, left in place, broke a "
            "hand loop at the answer)")


def forget_own_layout(result: ProbeResult) -> ProbeResult:
    """A cached answer as a hit returns it: the probe that wrote it laid out its own process's
    state; this process laid out nothing, so its note and figure go."""
    result.notes = [note for note in result.notes if not note.removeprefix(STORED_NOTE).startswith(LAID_OUT)]
    if result.promise is not None:
        result.promise.pop("laid_out_state_bytes", None)
    return result


def release_after_probe(device: torch.device, *, workspaces: bool = False) -> None:
    """Return the cached blocks the trials left, so training starts from a fresh allocator;
    with ``workspaces`` (a hand loop's probe) the cuBLAS workspaces too, which the loop's first
    step then makes among its activations, as a new process's does."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        if workspaces:
            release_workspaces(device)
        torch.cuda.empty_cache()
