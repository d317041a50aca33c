"""Optimizer state a probe created, laid out as loading a checkpoint places it.

A plain callable (``find_max_batch(step_fn)``, the form Accelerate users bring) trains for
real in its trials, and its optimizer creates its state (Adam's moments) in the first trial
that steps, among that trial's freed activations: at batch 8 when the answer is 180. Left
there, that state pins segments laid out for a far smaller step, and the training that follows
works around them. Measured on an NVIDIA H100 80GB (ResNet-50, bf16, AdamW, 8 GiB cap; ``python
scripts/diag_retries.py --forms plain --relayout R``): a hand loop at the then answer, 180, ran
out of memory at step 14 in 3 of 3 processes with the state left where the probe made it.

:func:`relayout_as_loaded` lays the state out the way a run resumed from a checkpoint has it:
moved out of the way (a private memory pool of the caching allocator, ``torch.cuda.MemPool``: a
device-to-device copy, 0.01-0.06 s where a host round trip took 0.25-1.3 s), the cache
emptied, then copied back one by one into fresh memory above what stays resident, before any
step's activations. Values and tensor identities are kept. A hand loop's settle trials run in
that layout, and after the probe the state is left in it, so training in the probing process
starts in the layout the answer passed in (:mod:`~autobatch.probe.promise`). Where it was
tried instead, the state parked until the loop's first optimizer step (made among that step's
activations, as a new run makes it) held a second copy through that step: on an H100 ViT-B/16's
100 passed its trials laid out as loaded and then ran out of memory at step 3 of a hand loop in
the probing process (docs/promise-log.md). What finds no room on the way back stays in the pool
until the optimizer's next ``step()``, whose pre-hook copies it back (:class:`_Unpark`). State
that existed before the probe (a resumed run) is never moved.

A plain callable probed with ``hand_loop=False`` (its loop is never resumed, and its trials
ran in no particular layout) has its state parked instead (:func:`park_until_step`): moved to a
private pool and copied back at the optimizer's next ``step()``, after that step's backward,
where a new run makes it. On the H100 above the loop at 180 then flushed its cache for eight
steps and never again, 200 steps in 4 of 4 processes, where the state copied into fresh
segments of its own before the first step (the resumed layout) ran out of memory at step 5.

A Llama-style decoder's 5 passed its trials beside state where the trial at 4 made it, trained
from scratch, and ran out of memory at the second step of every hand loop resumed cold; laid
out as loaded, its trial fails 5 and the answer, 4, trains resumed (H200, 8 GiB cap, ``python
scripts/bench_promise.py --no-cli --workloads llama --resumed``).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable

import torch

from .allocator import expandable_segments
from .lazy_state import hooked, state_values
from .oom import recognised_ooms

__all__ = ["can_park", "park_until_step", "relayout_as_loaded"]


def can_park(device: torch.device) -> bool:
    """Whether state on ``device`` can be laid out again: a CUDA device whose torch has memory
    pools, and an allocator that splits fixed segments (with expandable segments there is
    nothing to avoid)."""
    return (device.type == "cuda" and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")
            and not expandable_segments())


def park_until_step(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Move ``tensors`` (``optimizer``'s state) into a private pool on ``device`` until the
    optimizer's next step; the bytes parked. Nothing is moved where :func:`can_park` is false."""
    if not can_park(device):
        return 0
    pool, into = _private_pool(device)
    return park(optimizer, tensors, into, keep=pool)


def park(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor],
         into: Callable[[], ContextManager], keep: object = None) -> int:
    """Copy each tensor's data into memory allocated under ``into()`` (the same tensor objects
    take the copies) and arm the optimizer's step pre-hook that copies them back at its next
    step. ``keep`` (the pool) lives until then. An out-of-memory error stops the parking where
    it is: what moved comes back at the step, what did not stays put."""
    moved = _move(_movable(tensors), into)
    _arm(optimizer, moved, keep)
    return _bytes(moved)


def relayout_as_loaded(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Lay ``tensors`` (``optimizer``'s state) out as loading a checkpoint does: moved out of the
    way (a private pool), the cache emptied, then copied back one by one into fresh memory above
    what stays resident, before any step's activations, as ``optimizer.load_state_dict`` places
    state loaded to the host (``torch.load(..., map_location="cpu")``); the bytes laid out again.
    Values and tensor objects are kept; what finds no room stays parked until the optimizer's next
    step.

    Why: a run resumed from a checkpoint makes its optimizer state before its first step,
    apart from that step's activations, where a new run makes it among them, and the
    allocator's wall can sit lower there. Measured on an H200 (8 GiB cap; docs/promise-log.md,
    "Resumed runs"): ResNet-50 as a hand loop trained 180 from scratch and ran out of memory at
    step 4 resumed, and in the probing process a loop at 180 with its state copied into fresh
    segments of its own failed at step 5; a Llama-style decoder's 5 trained from scratch and ran
    out of memory at the second step resumed.

    Not covered: a checkpoint loaded onto the device leaves its copy of the weights, freed, in the
    allocator's cache below the state. On an H100 (8 GiB cap) the decoder's 5 passed its trial in
    this layout and ran out of memory at the first step of a hand loop whose state was made after
    as many bytes of gradients, freed before the step; standing those bytes in during the
    trials instead kept ResNet-50's steps flushing down to 159 (of 177). ``del checkpoint;
    torch.cuda.empty_cache()`` after loading returns them, leaving this layout. Nothing moves
    where :func:`can_park` is false: off
    CUDA, and with expandable segments (on an H200 a ResNet-50 loop at the wall made no allocator
    retries with them)."""
    if not can_park(device):
        return 0
    pool, into = _private_pool(device)

    def empty() -> None:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()

    return lay_out(optimizer, tensors, into, empty, pool)


def lay_out(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor], into: Callable[[], ContextManager],
            empty: Callable[[], None], keep: object = None) -> int:
    """:func:`relayout_as_loaded`'s moves, with the pool's context (``into``), the cache's
    emptying (``empty``) and the pool (``keep``) given: each tensor's data copied under
    ``into()`` (the same tensor objects take the copies), ``empty()``, then copied back in
    order; the bytes back. An out-of-memory error stops either pass where it is: what did not
    move out stays put, and what did not come back waits (``keep`` alive) for the optimizer's
    next step."""
    out = _move(_movable(tensors), into)
    empty()
    back = _move(out, nullcontext)
    _disarm(optimizer, back)  # laid out for good: an earlier wait for the step is off
    _arm(optimizer, out[len(back):], keep)
    return _bytes(back)


def _movable(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors whose data may be swapped for a copy: plain tensors (a DTensor's shards are
    left alone) that own their storage (a view of a flat buffer, as some optimizers keep their
    state, would part from its buffer)."""
    return [t for t in tensors if type(t) is torch.Tensor and t._base is None
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()]


def _move(tensors: list[torch.Tensor], into: Callable[[], ContextManager]) -> list[torch.Tensor]:
    """Give each tensor a copy of its data allocated under ``into()``, in order, until one finds
    no room; the tensors moved."""
    moved: list[torch.Tensor] = []
    with torch.no_grad():
        for tensor in tensors:
            try:
                with into():
                    copy = tensor.data.clone()
            except torch.OutOfMemoryError:  # ours, counted as recognised: no trial takes it for a step's own catch
                recognised_ooms(1)
                break
            tensor.data = copy
            moved.append(tensor)
    return moved


def _arm(optimizer: torch.optim.Optimizer, moved: list[torch.Tensor], keep: object) -> None:
    """Bring ``moved`` back into the default pool at ``optimizer``'s next step."""
    if moved:
        hook = _HOOKS.get(optimizer)
        if hook is None:
            hook = _HOOKS[optimizer] = _Unpark(optimizer)
        hook.arm(moved, keep)


def _private_pool(device: torch.device) -> tuple[object, Callable[[], ContextManager]]:
    """A new private memory pool on ``device`` and the context that allocates from it (a pool is
    bound to one numbered device: an unnumbered ``cuda`` is the current one)."""
    device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.MemPool()
    return pool, lambda: torch.cuda.use_mem_pool(pool, device)


def _disarm(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
    """Take ``tensors`` off ``optimizer``'s pending copy-back (their pools go with the last)."""
    hook = _HOOKS.get(optimizer)
    if hook is not None:
        ids = {id(t) for t in tensors}
        hook.refs = [ref for ref in hook.refs if ref() is not None and id(ref()) not in ids]
        hook.keep = hook.keep if hook.refs else []


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Unpark:
    """An optimizer's step pre-hook that brings parked state back at the next step.

    It stays registered, idle, once it has run (one per optimizer, armed again by a later
    probe): torch runs an optimizer's pre-hooks by iterating over their ordered dict, and a
    hook that removed itself there broke the step of any optimizer with a hook after it
    ("OrderedDict mutated during iteration", found on a GPU)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.refs: list[weakref.ref] = []
        self.keep: list[object] = []
        self.handle = hooked(optimizer).register_step_pre_hook(self)

    def arm(self, moved: list[torch.Tensor], keep: object) -> None:
        armed = {id(ref()) for ref in self.refs}
        self.refs += [weakref.ref(t) for t in moved if id(t) not in armed]  # state the user drops is not kept alive
        self.keep.append(keep)

    def __call__(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if not self.refs:
            return
        live = {id(t) for state in optimizer.state.values() for t in state_values(state) if isinstance(t, torch.Tensor)}
        refs, self.refs = self.refs, []
        with torch.no_grad():
            for ref in refs:
                tensor = ref()
                if tensor is not None and id(tensor) in live:  # not replaced by load_state_dict
                    tensor.data = tensor.data.clone()
        self.keep = []


#: each optimizer's hook (weakly: the hook does not keep its optimizer alive)
_HOOKS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Unpark]" = weakref.WeakKeyDictionary()
