"""What :class:`~autobatch.integrations.lightning.AutoBatchSize` saves before its trials and puts back.

The trials and the confirmation's loop runs train for real, so everything they change is put back
before ``fit`` trains: the module's parameters, buffers and gradients, every optimizer, the
precision plugin's scaler, the learning-rate schedulers, the random states, and the module's
state that is neither a parameter nor a buffer (:class:`ModuleAttributes`: a ``training_step``'s
gathered outputs, counters, a torchmetrics ``Metric``'s states). While the probe runs, no user
callback is called and the module's ``log`` does nothing (:func:`probing`). A checkpoint that
``fit(ckpt_path=...)`` loaded is host memory meanwhile (:func:`parked_checkpoint`).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from copy import deepcopy
from typing import Any, Iterator

import torch
from lightning.pytorch import LightningModule, Trainer

from ..memory.simulated import active_simulation, host_memory, to_simulated_device
from ..probe.snapshot.restore import Snapshot
from ..probe.snapshot.restore_places import unskipped
from ..training.checkpoints.checkpoint_io import rng_state, set_rng_state

__all__ = ["ModuleAttributes", "SavedState", "parked_checkpoint", "probing"]

#: ``nn.Module``'s own bookkeeping (parameters, buffers, child modules, hooks, ``training``):
#: the snapshot of parameters and buffers covers what of it a step changes
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)


class ModuleAttributes:
    """The plain attributes of a module and of every module inside it (what ``__dict__`` holds
    beside ``nn.Module``'s own bookkeeping), shallow: a list, dict or set keeps its items, a
    tensor its values (a host copy; a torchmetrics ``Metric`` updates its states in place),
    anything else its reference.

    Why: a ``training_step`` that appends its outputs to ``self.training_step_outputs``
    (Lightning 2's epoch-end pattern), counts samples, or updates a metric changes the module
    at every trial; without this the outputs pile up over the trials (the probe ran out of
    memory at batch 1) and ``fit`` starts from the trials' counts.

    Each parameter's ``requires_grad`` flag is put back too: a manual-optimization step that
    calls ``toggle_optimizer`` (a GAN's) freezes the other optimizers' parameters until its
    ``untoggle_optimizer``; a trial that ran out of memory in between left them frozen, the next
    trial's toggle saved them as frozen, and its discriminator loss had no gradient (a
    ``RuntimeError`` ended the probe)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.saved: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]] = []
        self.requires_grad = [(param, param.requires_grad) for param in module.parameters()]
        with host_memory():  # host copies: on an accelerator they take none of its memory
            for child in module.modules():
                values = {k: v for k, v in vars(child).items() if k not in _MODULE_KEYS}
                self.saved.append((child, values, {k: _copy(v) for k, v in values.items()}))

    def restore(self, *, drop_new: bool = True) -> None:
        """Put every attribute back (its object, with its saved contents). ``drop_new``: remove
        attributes set since the snapshot (not while the probe's own ``log`` stand-ins are set)."""
        for param, flag in self.requires_grad:
            if param.requires_grad != flag:
                param.requires_grad_(flag)
        for child, values, copies in self.saved:
            attributes = vars(child)
            if drop_new:
                for name in [k for k in attributes if k not in values and k not in _MODULE_KEYS]:
                    del attributes[name]
            for name, value in values.items():
                attributes[name] = _put_back(value, copies[name])


def _copy(value: Any) -> Any:
    """What :func:`_put_back` needs to restore ``value``'s contents (None: its reference is enough)."""
    if isinstance(value, torch.Tensor):
        if value.is_meta or value._base is not None:
            return None  # no values, or a view: its base (a parameter, a buffer, an attribute) is restored
        version = None if value.is_inference() else value._version
        return value.detach().to("cpu", copy=True), version
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return set(value) if isinstance(value, set) else None


def _put_back(value: Any, saved: Any) -> Any:
    """``value`` with the contents it had when ``saved`` was taken (in place where it can)."""
    if isinstance(value, torch.Tensor) and saved is not None:
        data, version = saved
        if version is not None and value._version == version:
            return value  # not written in place since
        if version is None or value.shape != data.shape or value.dtype != data.dtype:
            return data.to(value.device, copy=True)
        with torch.no_grad():
            value.copy_(data)
        return value
    if isinstance(value, list):
        value[:] = saved
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(saved)
    return value


class SavedState:
    """Snapshots of the module (parameters, buffers, gradients, plain attributes), every
    optimizer, the precision plugin's scaler, the learning-rate schedulers and the random
    states; :meth:`reset` puts them back, as often as needed."""

    def __init__(self, trainer: Trainer, module: LightningModule) -> None:
        optimizers = list(trainer.optimizers) or [None]
        with host_memory():  # host copies: on an accelerator they take none of its memory
            self.snapshots = [Snapshot.take(module if i == 0 else None, opt) for i, opt in enumerate(optimizers)]
            self.randoms = rng_state()
        self.attributes = ModuleAttributes(module)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scaler = scaler if callable(getattr(scaler, "state_dict", None)) else None
        self.scaler_state = None if self.scaler is None else self.scaler.state_dict()
        # the confirmation's loop runs step the schedulers: OneCycleLR would run out of steps in fit
        self.schedulers = [(config.scheduler, deepcopy(config.scheduler.state_dict()))
                           for config in trainer.lr_scheduler_configs]
        unskipped([self.scaler])  # the trials at scale 1: no optimizer step skipped (its state made)

    def reset(self, final: bool = False) -> None:
        """Put everything back; until the ``final`` reset the scaler runs at scale 1 again (the
        probe's trials and the confirmation's loop: a scaled gradient that overflows skips the
        optimizer's step, which then makes no state, and the size is measured without it)."""
        for snapshot in reversed(self.snapshots):
            snapshot.restore()
        self.attributes.restore()
        if self.scaler is not None:
            self.scaler.load_state_dict(self.scaler_state)
            # the per-optimizer marks (unscaled, stepped) only an enabled GradScaler keeps: a disabled
            # one (a plugin given GradScaler(enabled=False)) has none, and clearing them raised
            # AttributeError ('_per_optimizer_states') at fit start, after the probe
            if isinstance(self.scaler, torch.amp.GradScaler) and self.scaler.is_enabled():
                from torch.amp.grad_scaler import _refresh_per_optimizer_state

                self.scaler._per_optimizer_states.clear()
                self.scaler._per_optimizer_states.default_factory = _refresh_per_optimizer_state
        for scheduler, state in self.schedulers:
            scheduler.load_state_dict(deepcopy(state))
        set_rng_state(self.randoms)
        if not final:
            unskipped([self.scaler])

    @classmethod
    @contextmanager
    def kept(cls, trainer: Trainer, module: LightningModule) -> Iterator["SavedState"]:
        """The saved state; reset on the way out."""
        saved = cls(trainer, module)
        try:
            yield saved
        finally:
            saved.reset(final=True)


@contextmanager
def probing(trainer: Trainer, module: LightningModule) -> Iterator[None]:
    """While the probe runs: no user callback's hook is called (the trials run the precision
    plugin's backward and optimizer step, which call ``on_before_backward``, ``on_after_backward``
    and ``on_before_optimizer_step``: a callback counting steps or tracking gradient norms would
    count the trials; no callback hook runs outside fit's own steps), and the module's
    ``log``/``log_dict`` do nothing (no loop runs to receive them)."""
    callbacks = trainer.callbacks
    with ExitStack() as stack:
        trainer.callbacks = []
        stack.callback(setattr, trainer, "callbacks", callbacks)
        for name in ("log", "log_dict"):
            setattr(module, name, lambda *args, **kwargs: None)
            stack.callback(delattr, module, name)
        yield


@contextmanager
def parked_checkpoint(trainer: Trainer) -> Iterator[None]:
    """While the callback probes and confirms: the checkpoint ``fit(ckpt_path=...)`` loaded is
    host memory, and is not counted as the device's.

    Lightning holds the loaded checkpoint (weights and optimizer moments) from before
    ``on_fit_start`` until it restores the optimizers, just before the first step. Its own
    ``CheckpointIO`` loads it into host memory (on an H200 every tensor was on the CPU), which
    a GPU's probe does not see; under :func:`~autobatch.memory.simulated.simulated_memory`,
    where the CPU is the device, it was counted, and a run resumed from a checkpoint without this
    callback's state found no batch under 2 MiB (``NoBatchFitsError`` at batch 1) where a plain
    resumed ``fit`` trains at 200. Its tensors are host copies outside the simulated budget
    meanwhile (:func:`~autobatch.memory.simulated.host_memory`), as on a GPU; a tensor a custom
    ``CheckpointIO`` loaded onto an accelerator is moved to the host too. All go back after."""
    connector = trainer._checkpoint_connector
    loaded = connector._loaded_checkpoint
    simulated = active_simulation() is not None
    if not isinstance(loaded, dict) or not loaded:
        yield
        return
    places: dict[int, torch.device] = {}

    def park(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or (value.device.type == "cpu" and not simulated):
            return value
        with host_memory():
            copy = value.detach().to("cpu", copy=True)
        places[id(copy)] = value.device
        return copy

    def unpark(value: Any) -> Any:
        device = places.get(id(value)) if isinstance(value, torch.Tensor) else None
        if device is None:
            return value
        return to_simulated_device(value) if device.type == "cpu" else value.to(device)

    connector._loaded_checkpoint = _mapped(loaded, park)
    del loaded  # the device copies go with the last reference
    try:
        yield
    finally:
        connector._loaded_checkpoint = _mapped(connector._loaded_checkpoint, unpark)


def _mapped(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to every item in its dicts, lists and tuples (new containers)."""
    if isinstance(value, dict):
        mapped = value.copy()  # its own type (an OrderedDict state dict)
        for key, item in value.items():
            mapped[key] = _mapped(item, fn)
        return mapped
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_mapped(item, fn) for item in value)
    return fn(value)
