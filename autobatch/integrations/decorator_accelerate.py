"""What :func:`~autobatch.integrations.decorator.find_executable_batch_size` reads from, and does to,
Accelerate's process-wide state: its shared ``GradientState`` (:func:`gradient_state`, the active
data loaders and the accumulation of every Accelerator, :func:`accumulation_steps`), its shared
``AcceleratorState`` (the mixed precision, :func:`collect_mixed_precision`), and the Accelerators the
decorator's scans found (:data:`ACCELERATORS`: their micro-batch counters, :func:`put_back_steps`, and
their ``free_memory``, :func:`collect_on_free` / :func:`restore_free_memory`).

Why one module: each of these reads a singleton that Accelerate shares between every Accelerator of the
process (``GradientState``, ``AcceleratorState``) or patches an Accelerator, by name, where Accelerate is
imported (``sys.modules``, never imported here: a process without it pays nothing), and each must stay in
step with Accelerate's private attributes (``_shared_state``, ``num_steps``, ``dataloader_references``). What a
failed attempt leaves behind, and when each of these runs, is :mod:`.decorator_state`'s.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any, Callable

from ..memory.oom import free_memory

__all__ = ["ACCELERATORS", "accumulation_steps", "collect_mixed_precision", "collect_on_free", "gradient_state",
           "put_back_steps", "restore_free_memory"]

#: Accelerators whose ``step`` is recorded at each attempt's start: found by the garbage-collector scans of
#: :mod:`.decorator_state` (the process's first decorated call, each failure)
ACCELERATORS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def gradient_state() -> Any | None:
    """Accelerate's shared ``GradientState`` (every Accelerator's ``gradient_state``), or None where
    Accelerate is not imported or no Accelerator made it (none is created here)."""
    module = sys.modules.get("accelerate.state")
    kind = getattr(module, "GradientState", None)
    if not isinstance(kind, type) or not getattr(kind, "_shared_state", None):
        return None
    state = kind()  # binds the shared state that exists; changes nothing
    return state if isinstance(getattr(state, "dataloader_references", None), list) else None


def accumulation_steps(*, live: bool = False) -> int:
    """The micro-batches an ``accelerate.Accelerator`` accumulates a step
    (``gradient_accumulation_steps``, shared by every Accelerator of the process); 1 without one.
    ``live``: 1 too where no Accelerator the scans found is alive (the shared state outlives them)."""
    state = gradient_state() if not live or len(ACCELERATORS) else None
    steps = getattr(state, "num_steps", 1) if state is not None else 1
    return steps if isinstance(steps, int) and steps > 0 else 1


def collect_mixed_precision() -> None:
    """At a call's start, a collection (as Accelerate's decorator runs at every call), where Accelerate's
    shared state has a mixed precision: a model prepared under it holds itself (its forward is bound to it,
    wrapped in autocast), so the last call's lived on, and this call's first attempt failed at the size
    that had run (each call ran smaller). Only there: a full collection costs 0.1-0.4 s a call in a
    process that imported transformers (a decorated helper called every step), and elsewhere no such cycle."""
    shared = getattr(getattr(sys.modules.get("accelerate.state"), "AcceleratorState", None), "_shared_state", None)
    if isinstance(shared, dict) and shared.get("_mixed_precision") not in (None, "no"):
        free_memory()


def put_back_steps(steps: dict[int, tuple[weakref.ref, int]], accelerators: list[Any]) -> None:
    """Each Accelerator's ``step`` as ``steps`` (read at the attempt's start) has it; one the attempt's
    start did not know (made after the process's first decorated call) back to its window's start."""
    for accelerator in accelerators:
        step = getattr(accelerator, "step", None)
        if not isinstance(step, int):
            continue
        ref, before = steps.get(id(accelerator), (None, None))
        if ref is not None and ref() is accelerator:
            accelerator.step = before
        else:
            window = getattr(accelerator, "gradient_accumulation_steps", 1)
            accelerator.step = step - step % window if isinstance(window, int) and window > 1 else step
        ACCELERATORS.add(accelerator)


def collect_on_free(collecting: dict[int, tuple[weakref.ref, Any]], accelerators: list[Any],
                    freed: Callable[[], Callable[[], None] | None]) -> None:
    """Each of ``accelerators`` not yet in ``collecting`` gets a ``free_memory`` that runs
    ``gc.collect()`` after Accelerate's, then ``freed()()`` where ``freed()`` answers a callable
    (a weak reference to the call's bound method: the memory in use is read there); ``collecting`` keeps
    each one's own, for :func:`restore_free_memory`. Why: :mod:`.decorator_state` (the failed attempt's
    model, held by a cycle, outlived the ``free_memory()`` at the function's top). Held weakly: no cycle."""
    for accelerator in accelerators:
        if id(accelerator) in collecting or not callable(getattr(accelerator, "free_memory", None)):
            continue
        ref, own = weakref.ref(accelerator), vars(accelerator).get("free_memory")

        def free_memory(*objects: Any, _ref: weakref.ref = ref, _own: Any = own) -> Any:  # Accelerate's name
            target = _ref()
            result = _own(*objects) if _own is not None else type(target).free_memory(target, *objects)
            gc.collect()  # what the lists Accelerate emptied held, cycles too
            if (then := freed()) is not None:
                then()  # where the attempt starts
            return result

        accelerator.free_memory = free_memory
        collecting[id(accelerator)] = (ref, own)


def restore_free_memory(collecting: dict[int, tuple[weakref.ref, Any]]) -> None:
    """Each Accelerator's ``free_memory`` as the call found it (:func:`collect_on_free`); ``collecting`` emptied."""
    for ref, own in collecting.values():
        if (accelerator := ref()) is not None:
            if own is None:
                vars(accelerator).pop("free_memory", None)
            else:
                accelerator.free_memory = own
    collecting.clear()
