"""What a failed attempt of :func:`~autobatch.integrations.decorator.find_executable_batch_size`
leaves behind outside the function, and how it is undone before the next attempt
(:class:`AttemptState`):

* **gradients**: the failed attempt's are dropped, those it left alone are kept;
* a ``GradScaler``'s **unscale mark** (fp16 with gradient clipping: ``scaler.unscale_(optimizer)``
  then ``clip_grad_norm_``): forgotten where the attempt's gradients were dropped, or the next
  attempt's ``unscale_`` raised "unscale_() has already been called on this optimizer since the
  last update()";
* an ``accelerate.Accelerator``'s **micro-batch counter** (``accelerator.step``, which
  ``accelerator.accumulate`` advances): put back, or the next attempt's accumulation windows were
  shifted by the failed attempt's micro-batches (with 4 a window and a failure at the third, the
  retry stepped the optimizer after its first micro-batch, a quarter of a window).

Torch and Accelerate objects are found by the garbage collector: once at the process's first
decorated call (a scan costs 20-90 ms in a large process), then after each failure; optimizers
seen stepping since are known through a global step pre-hook. Nothing is copied: weak references
and version counters.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["AttemptState"]


class AttemptState:
    """The gradients of the known optimizers' parameters, and the known Accelerators' micro-batch
    counters, as each attempt started, so that a failed attempt's are undone and the others kept.

    Why not every gradient: a training loop half-way through an accumulation window that calls a
    decorated helper (a ``no_grad`` evaluation) lost its accumulated gradients to the helper's
    first OOM. After a failure every live optimizer is found (a failure may come before any
    optimizer stepped), and a gradient with no record from the attempt's start (the attempt made
    it, or an optimizer made since the first scan that never stepped holds it) is dropped."""

    def __init__(self) -> None:
        self.before: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}
        self.steps: dict[int, tuple[weakref.ref, int]] = {}

    def record(self) -> None:
        """At an attempt's start: each parameter's gradient (weakly) and its version counter, and
        each known Accelerator's ``step``."""
        self.before = {}
        for param in _params_of(_known_optimizers()):
            if param.grad is not None:
                self.before[id(param)] = (weakref.ref(param), weakref.ref(param.grad), param.grad._version)
        self.steps = {id(accelerator): (weakref.ref(accelerator), accelerator.step) for accelerator in list(_ACCELERATORS)
                      if isinstance(getattr(accelerator, "step", None), int)}

    def drop_failed(self) -> int:
        """After a failed attempt: ``.grad = None`` where the attempt created the gradient or changed
        it (read from ``param_groups``, not through ``zero_grad``, which a wrapper such as
        Accelerate's skips while it accumulates); the scalers' marks on the dropped gradients
        forgotten; the Accelerators' counters put back. Returns how many gradients that existed
        before the attempt it changed in place: what they held before the call is lost."""
        lost = 0
        live, scalers, accelerators = _live_objects()
        _KNOWN.update(live)
        for param in _params_of(live):
            grad = param.grad
            if grad is None:
                continue
            ref, old, version = self.before.get(id(param), (None, None, None))
            if ref is not None and ref() is param and old() is grad:
                if grad._version == version:
                    continue  # untouched by the failed attempt
                lost += 1
            param.grad = None
        _forget_unscaled(scalers, live)
        self._put_back_steps(accelerators)
        return lost

    def _put_back_steps(self, accelerators: list[Any]) -> None:
        """Each Accelerator's ``step`` as the attempt found it; one the attempt's start did not know
        (made after the process's first decorated call) back to its window's start."""
        for accelerator in accelerators:
            step = getattr(accelerator, "step", None)
            if not isinstance(step, int):
                continue
            ref, before = self.steps.get(id(accelerator), (None, None))
            if ref is not None and ref() is accelerator:
                accelerator.step = before
            else:
                window = getattr(accelerator, "gradient_accumulation_steps", 1)
                accelerator.step = step - step % window if isinstance(window, int) and window > 1 else step
            _ACCELERATORS.add(accelerator)


def _forget_unscaled(scalers: list[torch.amp.GradScaler], optimizers: list[torch.optim.Optimizer]) -> None:
    """After a failed attempt, mark unscaled again, in every enabled ``GradScaler``, each optimizer
    left ``unscale_``d or stepped that holds no gradient any more (the failed attempt's were dropped)
    or is gone. Why: an attempt that ran out of memory after ``scaler.unscale_(optimizer)`` (fp16
    with gradient clipping) left the optimizer marked, and the next attempt's ``unscale_`` raised
    "unscale_() has already been called on this optimizer since the last update()" (a new
    optimizer built inside the function may reuse the failed one's id, and raised the same). A mark
    whose gradients are kept (an ``unscale_`` by the caller before the call) stays."""
    by_id = {id(optimizer): optimizer for optimizer in optimizers}
    for scaler in scalers:
        states = getattr(scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict) or not scaler.is_enabled():
            continue
        for key, state in list(states.items()):
            if state.get("stage", OptState.READY) is OptState.READY:
                continue
            optimizer = by_id.get(key)
            if optimizer is None or all(param.grad is None for param in _params_of([optimizer])):
                states[key] = _refresh_per_optimizer_state()


#: optimizers whose gradients are recorded at each attempt's start: every live one when the first
#: decorated call ran, and every one seen stepping since (a global step pre-hook; a set insertion)
_KNOWN: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
#: Accelerators whose ``step`` is recorded at each attempt's start: found by the same scans
_ACCELERATORS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_SCANNED: list[bool] = []


def _known_optimizers() -> list[torch.optim.Optimizer]:
    """:data:`_KNOWN`, filled by one scan of the live objects on the first call in the process
    (which fills :data:`_ACCELERATORS` too)."""
    if not _SCANNED:
        optimizers, _, accelerators = _live_objects()
        _KNOWN.update(optimizers)
        _ACCELERATORS.update(accelerators)
        register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _KNOWN.add(optimizer))
        _SCANNED.append(True)
    return list(_KNOWN)


def _live_objects() -> tuple[list[torch.optim.Optimizer], list[torch.amp.GradScaler], list[Any]]:
    """Every live optimizer (a wrapper such as Accelerate's ``AcceleratedOptimizer`` is found with
    the torch optimizer it holds), every live ``GradScaler`` (an Accelerator's too) and, where
    Accelerate is imported, every live ``Accelerator``, in one scan of the garbage collector's
    objects."""
    accelerate = sys.modules.get("accelerate")
    accelerator_class = getattr(accelerate, "Accelerator", None) if accelerate is not None else None
    bases = [torch.optim.Optimizer, torch.amp.GradScaler] + ([accelerator_class] if isinstance(accelerator_class, type) else [])
    found: dict[type, list[Any]] = {}
    for base in bases:
        into: list[Any] = []
        stack = [base]
        found[base] = into
        while stack:  # the subclasses, so the scan tests type() in a dict (twice as fast as issubclass)
            kind = stack.pop()
            found[kind] = into
            stack.extend(sub for sub in kind.__subclasses__() if sub not in found)
    # type(), not isinstance(): isinstance reads ``__class__``, which lazy proxies and deprecated
    # module attributes answer with a warning or an import
    for obj in gc.get_objects():
        into = found.get(type(obj))
        if into is not None:
            into.append(obj)
    accelerators = found[accelerator_class] if len(bases) > 2 else []
    return found[torch.optim.Optimizer], found[torch.amp.GradScaler], accelerators


def _params_of(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every parameter of ``optimizers``, each once."""
    params: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", None) or ():
            for param in group.get("params", ()) if isinstance(group, dict) else ():
                if isinstance(param, torch.Tensor):
                    params.setdefault(id(param), param)
    return list(params.values())
