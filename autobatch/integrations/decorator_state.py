"""What a failed attempt of :func:`~autobatch.integrations.decorator.find_executable_batch_size`
leaves behind outside the function, and how it is undone before the next attempt
(:class:`AttemptState`):

* **gradients**: the failed attempt's are dropped, those it left alone are kept;
* Accelerate's **active data loaders** (``GradientState.dataloader_references``): a prepared loader
  whose loop the failure ended never leaves them (it leaves at its loop's end), so after the call
  ``accelerator.gradient_state.in_dataloader`` stayed True and ``end_of_dataloader`` answered the
  dead loop's (where it failed at its last batch, ``accelerator.accumulate`` in a later loop over
  an unprepared iterable synced every micro-batch); they are put back as the attempt found them;
* a ``GradScaler``'s **unscale mark** (fp16 with gradient clipping: ``scaler.unscale_(optimizer)``
  then ``clip_grad_norm_``): forgotten where the attempt's gradients were dropped, or the next
  attempt's ``unscale_`` raised "unscale_() has already been called on this optimizer since the
  last update()";
* an ``accelerate.Accelerator``'s **micro-batch counter** (``accelerator.step``, which
  ``accelerator.accumulate`` advances): put back, or the next attempt's accumulation windows were
  shifted by the failed attempt's micro-batches (with 4 a window and a failure at the third, the
  retry stepped the optimizer after its first micro-batch, a quarter of a window);
* an ``accelerate.Accelerator``'s ``free_memory()`` collects the garbage it makes: from the call's
  start (each one known then) and each failure (each one live), it gets a ``free_memory`` that runs
  ``gc.collect()`` after it lets go of its models (the call's own, put back when the call ends).
  Why: Accelerate's collects *before* it empties its lists, and a model prepared under mixed
  precision holds itself (its forward is bound to it, wrapped in autocast), so the failed attempt's
  model, freed by the ``free_memory()`` at the function's top that Accelerate's docs (and these)
  advise, lived on through the retry: a bf16 MLP under 7 MiB failed at every size down to batch 1
  where 921 runs; and the previous call's (a new epoch, a notebook cell run again) through the next
  call's first attempt, which failed at the size that ran, so each call ran smaller (256, 243, 193);
  the memory in use after it is where the attempt starts (:meth:`AttemptState.started`);
* a retry that loads a checkpoint a failed attempt saved and skips its done batches at another
  batch size (``accelerator.skip_first_batches``) is one warning (:mod:`.decorator_resume`);
* the **updates** a failed attempt made through an optimizer that the retry steps again (made
  before the call) cannot be undone without a copy: they are counted (:class:`RetrainedSteps`),
  and a call that returns after a retry that did not load a checkpoint into it is one warning.

Torch and Accelerate objects are found by the garbage collector: once at the process's first
decorated call (a scan costs 20-90 ms in a large process), then after each failure; optimizers
seen stepping since are known through a global step pre-hook. Nothing is copied: weak references
and version counters. What reads Accelerate's shared state, or patches an Accelerator, is
:mod:`.decorator_accelerate`'s.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .decorator_accelerate import (ACCELERATORS, accumulation_steps, collect_on_free, gradient_state, put_back_steps,
                                   restore_free_memory)
from .decorator_resume import ResumeWatch

__all__ = ["AttemptState", "RetrainedSteps"]


class AttemptState:
    """The gradients of the known optimizers' parameters, and the known Accelerators' micro-batch
    counters, as each attempt started, so that a failed attempt's are undone and the others kept.

    Why not every gradient: a training loop half-way through an accumulation window that calls a
    decorated helper (a ``no_grad`` evaluation) lost its accumulated gradients to the helper's
    first OOM. After a failure every live optimizer is found (a failure may come before any
    optimizer stepped), and a gradient with no record from the attempt's start (the attempt made
    it, or an optimizer made since the first scan that never stepped holds it) is dropped."""

    def __init__(self, memory: Any = None, name: str = "function") -> None:
        self.memory = memory  # the decorator's instruments (a DeviceMemory), or None
        self.resume = ResumeWatch(name)  # checkpoints saved and skipped across attempts
        #: the memory in use after the attempt's own ``accelerator.free_memory()`` (:meth:`started`)
        self.freed_to: int | None = None
        self.before: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}
        self.steps: dict[int, tuple[weakref.ref, int]] = {}
        self.loaders: list[Any] | None = None
        self.retrained = RetrainedSteps()
        self.found: tuple[list[weakref.ref], list[weakref.ref], list[weakref.ref], list[weakref.ref]] | None = None
        self.collecting: dict[int, tuple[weakref.ref, Any]] = {}  # Accelerators whose free_memory collects
        #: the Accelerator's accumulation as the call's first attempt failed, the one it asked for where
        #: the function sets it from its size (:meth:`note_failure`); None before a failure
        self.first_accumulation: int | None = None
        #: an Accelerator was alive at one of the call's failures: one the function makes inside
        #: (Accelerate's pattern) is gone when the call returns, and its accumulation still counts
        self.accelerated = False

    def __enter__(self) -> "AttemptState":
        self.resume.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.retrained.close()  # the load_state_dict hooks go, whatever happened
        self.resume.__exit__(*exc)  # and the Accelerator's own save/load/skip methods come back
        restore_free_memory(self.collecting)  # each Accelerator's free_memory as the call found it

    def record(self, size: int | None = None) -> None:
        """At an attempt's start (at batch ``size``): each parameter's gradient (weakly) and its
        version counter, and each known Accelerator's ``step``; its ``free_memory`` collects (module doc)."""
        self.before, self.freed_to = {}, None
        if size is not None:
            self.resume.started(size)
        self.retrained.record()
        for param in _params_of(_known_optimizers()):  # the first call's scan fills ACCELERATORS too
            if param.grad is not None:
                self.before[id(param)] = (weakref.ref(param), weakref.ref(param.grad), param.grad._version)
        self.steps = {id(accelerator): (weakref.ref(accelerator), accelerator.step) for accelerator in list(ACCELERATORS)
                      if isinstance(getattr(accelerator, "step", None), int)}
        state = gradient_state()
        self.loaders = list(state.dataloader_references) if state is not None else None
        self._collect_on_free(list(ACCELERATORS))  # the last call's bf16 model, before this call's first attempt

    def note_failure(self) -> None:
        """In the failed attempt's ``except`` handler, while its frames are alive: the live
        optimizers, scalers and Accelerators, and the optimizers' parameters, each weakly (nothing
        kept alive). Why there: an optimizer made inside the function over a model made outside
        dies with the failed frames, and a scan after the handler missed it, so the gradients its
        attempt's backward left on that model stayed and the retry's first step applied the sum of
        two backward passes. Also the accumulation the call's first attempt ran with: a function that
        sets ``accelerator.gradient_accumulation_steps = 512 // batch_size`` under an ``Accelerator()``
        of 1 asked for 512 a step, not the 128 x 1 of the call's start."""
        optimizers, scalers, accelerators = _live_objects()
        if self.first_accumulation is None:
            self.first_accumulation = accumulation_steps() if accelerators else 1
        self.accelerated = self.accelerated or bool(accelerators)
        self.found = ([weakref.ref(item) for item in optimizers], [weakref.ref(item) for item in scalers],
                      [weakref.ref(item) for item in accelerators], [weakref.ref(item) for item in _params_of(optimizers)])

    def drop_failed(self) -> int:
        """After a failed attempt: ``.grad = None`` where the attempt created the gradient or changed
        it (read from ``param_groups``, not through ``zero_grad``, which a wrapper such as
        Accelerate's skips while it accumulates); the scalers' marks on the dropped gradients
        forgotten; the Accelerators' counters put back. Returns how many gradients that existed
        before the attempt it changed in place: what they held before the call is lost."""
        lost = 0
        self.retrained.failed()  # steps it took with optimizers that outlive it stay in the model
        if self.found is None:
            self.note_failure()
        live, scalers, accelerators, params = ([item for ref in refs if (item := ref()) is not None]
                                               for refs in self.found)  # type: ignore[union-attr]
        self.found = None
        _KNOWN.update(live)
        for param in params:  # each once, of every optimizer alive at the failure (note_failure)
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
        put_back_steps(self.steps, accelerators)
        self._collect_on_free(accelerators)
        if self.loaders is not None and (state := gradient_state()) is not None:
            state.dataloader_references = self.loaders  # the failed loop's loader is no longer active
        return lost

    def started(self, start: int | None) -> int | None:
        """The memory in use when the attempt started, ``start`` as read before the function ran, or
        less where the function's own ``accelerator.free_memory()`` (Accelerate's pattern, at its top)
        let go of the failed attempt's prepared model and optimizer. Why: their bytes were counted as
        in use at the retry's start, so a call that followed that advice was warned that memory kept by
        its failed attempts made its size smaller than the device allows, and told to call it."""
        return start if start is None or self.freed_to is None else min(start, self.freed_to)

    def _freed(self) -> None:
        """After a live Accelerator's ``free_memory`` ran during an attempt: the memory in use now."""
        if self.memory is not None:
            now = self.memory.allocated()
            self.freed_to = now if self.freed_to is None else min(self.freed_to, now)

    def _collect_on_free(self, accelerators: list[Any]) -> None:
        """Each of ``accelerators`` (once) gets, until the call ends, a ``free_memory`` that runs
        ``gc.collect()`` after Accelerate's (module description: the failed attempt's model, held
        by a cycle, outlived the ``free_memory()`` at the function's top), then :meth:`_freed`."""
        collect_on_free(self.collecting, accelerators, weakref.WeakMethod(self._freed))


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
_SCANNED: list[bool] = []


def _known_optimizers() -> list[torch.optim.Optimizer]:
    """:data:`_KNOWN`, filled by one scan of the live objects on the first call in the process
    (which fills :data:`ACCELERATORS` too)."""
    if not _SCANNED:
        optimizers, _, accelerators = _live_objects()
        _KNOWN.update(optimizers)
        ACCELERATORS.update(accelerators)
        register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _KNOWN.add(optimizer))
        register_optimizer_step_post_hook(_stepped)
        _SCANNED.append(True)
    return list(_KNOWN)


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step post-hook: a step that finished is counted (one an out-of-memory error
    interrupted, whose half-made state is repaired, is not), in all too (:data:`_ALL_STEPS`)."""
    _STEPS[optimizer] = _STEPS.get(optimizer, 0) + 1
    _ALL_STEPS[0] += 1


#: steps every optimizer has finished since the process's first decorated call, those gone since
#: included: an optimizer made inside the function (with its ``Accelerator``) is gone from
#: :data:`_STEPS` when the call returns, and the attempt that ran passed for one that never stepped
_ALL_STEPS: list[int] = [0]


#: steps each optimizer has finished since the process's first decorated call (:func:`_stepped`)
_STEPS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


class RetrainedSteps:
    """The optimizer steps that a call's failed attempts took with an optimizer that the attempt
    which ran stepped again (the caller's, made outside the function), and whether a later attempt
    loaded a state dict into it (a loop that resumes from its own checkpoint).

    Why: the retry runs the function from its top. A model and optimizer built inside start afresh,
    and a loop that loads its checkpoint resumes; but one passed in keeps the failed attempts'
    updates, and its data loop starts again at its first batch, so the samples of those steps were
    trained twice, silently (a run that ran out of memory on a long batch mid-epoch). An optimizer
    a failed attempt made and something outside kept (an ``Accelerator`` it was prepared with)
    and that the attempt which ran never stepped trained nothing twice, and is not counted."""

    def __init__(self) -> None:
        self.counts: dict[int, tuple[weakref.ref, int]] = {}
        self.taken: dict[int, tuple[weakref.ref, int]] = {}
        self.loaded: set[int] = set()
        self._hooks: dict[int, Any] = {}
        self.all_steps = _ALL_STEPS[0]

    def record(self) -> None:
        """At an attempt's start: the step count of each optimizer that has stepped, and of all."""
        self.counts = {id(optimizer): (weakref.ref(optimizer), steps) for optimizer, steps in list(_STEPS.items())}
        self.all_steps = _ALL_STEPS[0]

    def _since_start(self, optimizer: torch.optim.Optimizer, steps: int) -> int:
        ref, before = self.counts.get(id(optimizer), (None, 0))
        return steps - (before if ref is not None and ref() is optimizer else 0)

    def failed(self) -> None:
        """After a failed attempt: add the steps it took with each optimizer still alive, and watch
        each for a ``load_state_dict`` (a hook removed by :meth:`close`)."""
        for optimizer, steps in list(_STEPS.items()):
            if (taken := self._since_start(optimizer, steps)) <= 0:
                continue
            ref, before = self.taken.get(id(optimizer), (None, 0))
            before = before if ref is not None and ref() is optimizer else 0
            self.taken[id(optimizer)] = (weakref.ref(optimizer), before + taken)
            if id(optimizer) not in self._hooks and hasattr(optimizer, "register_load_state_dict_post_hook"):
                self._hooks[id(optimizer)] = optimizer.register_load_state_dict_post_hook(
                    lambda opt, key=id(optimizer): self.loaded.add(key))

    def twice(self) -> int:
        """After the attempt that ran: the failed attempts' steps with each optimizer it stepped too,
        that no attempt since loaded a state dict into: their samples were trained twice."""
        count = 0
        for key, (ref, taken) in self.taken.items():
            optimizer = ref()
            stepped = optimizer is not None and self._since_start(optimizer, _STEPS.get(optimizer, 0)) > 0
            if stepped and key not in self.loaded:
                count += taken
        return count

    def taken_total(self) -> int:
        """The steps the call's failed attempts took with optimizers still alive (stepped again or not)."""
        return sum(taken for ref, taken in self.taken.values() if ref() is not None)

    def stepped(self) -> bool:
        """Whether an optimizer stepped since the attempt's start (the function trains; a decorated
        inference helper does not), one the attempt made and let go of too."""
        return _ALL_STEPS[0] > self.all_steps or any(self._since_start(optimizer, steps) > 0 for optimizer, steps in list(_STEPS.items()))

    def close(self) -> None:
        """Remove the ``load_state_dict`` hooks."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()


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
