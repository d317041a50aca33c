"""What a :class:`~autobatch.probe.snapshot.restore.Snapshot` records beside the tensors it copies.

* The module tree's shape (:func:`layout_of`): forward may register a buffer the snapshot has
  no copy of (a lazily made attention mask), and the restore removes it again
  (:func:`put_back_layout`), where it failed with ``KeyError`` part-way.
* The places an active :func:`~autobatch.simulated_memory` budget counted (:func:`counted_places`):
  the snapshot and the restore work in host memory, which no budget counts, and what the
  restore makes again (gradients, optimizer state) is made again as device memory only where
  the budget counted it before the probe, so a probe inside the block leaves it as it found it.
* Host copies of further objects' state dicts (:func:`host_copy`: an LR scheduler, a GradScaler),
  and loading them back (:func:`load_other`).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import torch

from ...memory.devices import simulated_counts
from ...memory.simulated import active_simulation
from .ddp_reducer import reset_failed_reduction
from .shards import to_cpu_local

__all__ = ["SCHEDULERS", "written_outside_the_optimizer", "outside_the_model", "after_failed_step", "attempt", "forget_scaler_stage", "unskipped", "host_copy", "layout_of", "put_back_layout", "put_back_requires_grad", "all_params", "places",
           "counted_places", "load_keeping_groups", "load_other"]

#: LR schedulers: a further object of ``restore`` put back between trials too (their steps count)
SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

#: What a module registers by name, and forward may add to.
_KINDS = ("_parameters", "_buffers", "_modules")


def attempt(stage: Callable[[], object], errors: list[BaseException]) -> None:
    """Run one stage of a restore; an error is kept for after the stages that follow."""
    try:
        stage()
    except BaseException as exc:  # noqa: BLE001 - raised once every stage ran (Snapshot.restore)
        errors.append(exc)


def host_copy(state: Any) -> Any:
    """A host copy of another object's ``state_dict()`` (tensors copied to the CPU, values
    deep-copied), sharing nothing with it; functions it holds (a ``LambdaLR``'s lambdas) are
    kept as they are, for a bound method's deep copy would copy its object (an optimizer)."""
    return to_cpu_local(state, lambda value: value if callable(value) else copy.deepcopy(value))


def layout_of(model: torch.nn.Module | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Each module's parameter, buffer and submodule names, by module name, each with what it
    held: a tensor's device, True for a submodule, False for nothing (a buffer registered as
    None): what forward may add to, or clear."""
    if model is None:
        return {}
    # not a TorchScript module's: its forward cannot register or clear anything, and its
    # _parameters/_buffers/_modules wrappers cannot be iterated as dicts (a trial raised TypeError)
    return {name: {kind: {key: _held(value) for key, value in getattr(module, kind).items()}
                   for kind in _KINDS} for name, module in model.named_modules()
            if not isinstance(module, torch.jit.ScriptModule)}


def _held(value: Any) -> Any:
    return value.device if isinstance(value, torch.Tensor) else value is not None


def put_back_layout(model: torch.nn.Module, layout: dict[str, dict[str, dict[str, Any]]],
                    saved: dict[str, torch.Tensor] | None = None) -> None:
    """Undo what forward did to the module tree since :func:`layout_of`: a parameter, buffer or
    submodule registered during a trial (a lazily made attention mask) is removed, a slot that
    held None holds None again, and a buffer forward cleared (set to None, deleted) gets its
    ``saved`` copy back, on the device it was on."""
    for name, module in list(model.named_modules()):
        known = layout.get(name)
        if known is None:
            continue  # made by forward: removed from its parent below (or already); or TorchScript's (layout_of)
        for kind in _KINDS:
            current = getattr(module, kind)
            for key in [key for key in current if key not in known[kind]]:
                delattr(module, key)
            for key, held in known[kind].items():
                if not held and current.get(key) is not None:
                    current[key] = None
                full = f"{name}.{key}" if name else key
                if kind == "_buffers" and held and current.get(key) is None and saved and full in saved:
                    current[key] = saved[full].to(held, copy=True)


def all_params(model: torch.nn.Module | None, extra: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The model's named parameters, then those the optimizer trains outside it (``extra``)."""
    return [*(model.named_parameters() if model is not None else ()), *extra.items()]


def put_back_requires_grad(params: list[tuple[str, torch.Tensor]], saved: dict[str, bool]) -> None:
    """Each parameter's ``requires_grad`` as :class:`~.restore.Snapshot` found it. A GAN's step freezes
    the discriminator for the generator's loss (``toggle``) and unfreezes it after; a trial that ran out
    of memory in between left it frozen, and the next trial (or training after the probe) with it."""
    for name, param in params:
        if name in saved and param.requires_grad != saved[name]:
            param.requires_grad_(saved[name])


def places(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
           extra: dict[str, torch.Tensor]) -> Iterator[tuple[tuple, torch.Tensor]]:
    """``(place, tensor)`` for what a restore makes again rather than writes in place: each
    gradient (``("grad", name)``), buffer (``("buffer", name)``) and optimizer state tensor
    (``("state", index, key)``, the index as in ``state_dict()``)."""
    for name, param in all_params(model, extra):
        if param.grad is not None:
            yield ("grad", name), param.grad
    for name, buffer in model.named_buffers() if model is not None else ():
        yield ("buffer", name), buffer
    held = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    for index, param in enumerate(held):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                yield ("state", index, key), value


def counted_places(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                   extra: dict[str, torch.Tensor]) -> set[tuple]:
    """The places (:func:`places`) whose tensor an active simulated budget counts: made inside
    it, as device memory. The restore makes those again as device memory, and only those (a
    tensor made before the block, as the model's parameters, stays outside the budget)."""
    if active_simulation() is None:
        return set()
    return {place for place, tensor in places(model, optimizer, extra) if simulated_counts(tensor)}


def forget_scaler_stage(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer`` unscaled in ``scaler`` again: a step that failed after ``unscale_``
    left it marked, and the next step would skip unscaling (with the failed step's inf check).
    A disabled scaler (``GradScaler(enabled=use_fp16)``) keeps no marks: nothing to forget (its
    restore raised ``AttributeError: ... '_per_optimizer_states'`` after every probe)."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    if not scaler.is_enabled():
        return
    scaler._per_optimizer_states[id(optimizer)] = _refresh_per_optimizer_state()


def unskipped(scalers: Any) -> None:
    """Start every enabled ``GradScaler`` among ``scalers`` at scale 1 for a probe's trials (the
    snapshot has its state and puts it back after). A scaled gradient that overflows makes
    ``scaler.step`` skip the optimizer's step, and a skipped step makes no optimizer state: from
    ``init_scale=1e12`` every trial of an fp16 AdamW step was skipped, the answer was measured
    without Adam's moments, and training at it ran out of memory at step 21, once the scale had
    fallen far enough for the first real step. The scale changes no tensor's size."""
    for scaler in scalers:
        if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
            if scaler._scale is None:
                scaler._init_scale = 1.0  # made at the first scale(): from this value
            else:
                scaler._scale.fill_(1.0)


def after_failed_step(restore: tuple[Any, ...]) -> None:
    """After a plain callable's step ran out of memory: drop the gradients of every module in
    ``restore`` (the model, a GAN's discriminator), and mark every optimizer there unscaled again
    in every enabled ``GradScaler`` there (:func:`forget_scaler_stage`): a step that failed after
    ``scaler.unscale_(optimizer)`` left it marked, and the next trial's ``unscale_`` raised
    "unscale_() has already been called on this optimizer since the last update()"."""
    optimizers = [item for item in restore if isinstance(item, torch.optim.Optimizer)]
    for item in restore:
        if isinstance(item, torch.nn.Module):
            for param in item.parameters():
                param.grad = None
            reset_failed_reduction(item)  # a one-process DDP's reducer, left mid-backward
        elif isinstance(item, torch.amp.GradScaler) and item.is_enabled():
            for optimizer in optimizers:
                forget_scaler_stage(item, optimizer)


def load_other(other: Any, state: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a further object's saved ``state`` back (an optimizer keeping its groups); a
    ``GradScaler`` also forgets ``optimizer``'s unscale stage (:func:`forget_scaler_stage`)."""
    if isinstance(other, torch.optim.Optimizer):
        load_keeping_groups(other, state)
    else:
        other.load_state_dict(state)
    if isinstance(other, torch.amp.GradScaler) and optimizer is not None:
        forget_scaler_stage(other, optimizer)


def load_keeping_groups(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, its ``param_groups`` kept the same list and dicts:
    a scheduler or a user's warm-up that holds a group goes on writing the optimizer's own."""
    groups, dicts = optimizer.param_groups, list(optimizer.param_groups)
    optimizer.load_state_dict(state)
    for kept, loaded in zip(dicts, optimizer.param_groups):
        kept.clear()
        kept.update(loaded)
    groups[:] = dicts
    optimizer.param_groups = groups


def written_outside_the_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    """Ids of ``model``'s parameters that something other than ``optimizer.step()`` may write
    during a trial, so a snapshot that leaves the weights to the optimizer (a copy made while
    the first trial runs, or none at learning rate 0) must copy them first: an ``Embedding`` or
    ``EmbeddingBag`` with ``max_norm`` (forward renorms the rows it looks up, in place), and a
    parameter the optimizer does not hold that belongs to a module of the user's own (a
    vector quantizer's codebook updated by a moving average in forward). A module of
    ``torch.nn`` writes no parameter of its own in forward but those, so a frozen backbone's
    weights (LoRA) are not copied."""
    held = set() if optimizer is None else {id(p) for group in optimizer.param_groups for p in group["params"]}
    written: set[int] = set()
    for module in model.modules():
        renorms = isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.max_norm is not None
        own = not any(cls.__module__.startswith("torch.nn.") for cls in type(module).__mro__ if cls not in _BASES)
        for param in module.parameters(recurse=False):
            if renorms or (own and id(param) not in held):
                written.add(id(param))
    return written


_BASES = (torch.nn.Module, object)


def outside_the_model(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                       others: tuple[Any, ...] = ()) -> dict[str, torch.Tensor]:
    """The parameters ``optimizer``, and each further optimizer in ``others`` (a GAN's second one),
    train that ``model`` does not hold (a CLIP loss's ``logit_scale``; a discriminator not given as a
    module), named by their place in its ``param_groups``: the trials step them as the model's."""
    held, found = (set() if model is None else {id(param) for param in model.parameters()}), {}
    named = [("optimizer", optimizer)] + [(f"restore[{k + 2}]", o) for k, o in enumerate(others)]
    for where, opt in ((w, o) for w, o in named if isinstance(o, torch.optim.Optimizer)):
        for g, group in enumerate(opt.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in held:
                    held.add(id(param))
                    found[f"{where}.param_groups[{g}]['params'][{i}]"] = param
    return found
