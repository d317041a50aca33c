"""Put a model's buffers back as they were when a replayed global step began.

Why it is needed. Forward changes some buffers in place: BatchNorm's running mean and
variance and its batch counter, an exponential moving average a module keeps. When a global
step runs out of memory part-way, the micro-batches that already ran forward have updated
them, and the replay runs forward over the same samples again: without a restore the failed
attempt's updates stay, the statistics count those samples twice and ``num_batches_tracked``
is off, so the model in eval mode differs from that of a run that never failed.

What it does. :meth:`BufferGuard.capture`, at the start of every global step, keeps a host copy
of each buffer that changed since it was last copied, told by the tensor's identity and
version counter (an in-place operation bumps it, under ``no_grad`` too); a buffer that never
changes is copied once. The buffer's identity is a weak reference, not its ``id()``: forward that
replaces a buffer (``self.count = self.count + 1``) frees the old tensor, and a new one at the
same address with the same version (0) passed for the saved one, so its change was neither copied
nor undone (the replay counted the failed attempt's samples twice). The normalization layers' running statistics are copied every step:
the batch-norm kernels update them in place without bumping the counter (torch 2.13, CPU). So
a step copies only what forward changes (ResNet-50: its BatchNorm statistics, 0.2 MiB), into
host memory, which the device's budget (the probed maximum) never pays for.
:meth:`BufferGuard.restore`, at the top of a replay, writes back every buffer changed since: in
place, or by putting the saved tensor back where forward replaced the buffer object.
A write through ``.data`` bypasses the version counter and is not seen.

Parameters the optimizer does not train are guarded too where forward changes them: a
momentum encoder (MoCo's key encoder, updated under ``no_grad`` in forward) or an EMA teacher
kept as a submodule. Without it a replay applied the failed attempt's update a second time
(0.22 off the uninjected run's key encoder after 3 steps). A frozen backbone is never copied:
such a parameter is only watched (its version counter) until a step is seen changing it
(:meth:`BufferGuard.settle`, at the end of each trained step; a change made between steps, an
EMA in ``on_step_end``, is no change of the step), then copied at every step's start like a
buffer. The first step that changes it has no copy yet: if that step is replayed, the replay
keeps that attempt's change, and a warning says so. Either way a warning names such
parameters once: forward updates them once per micro-batch, so the update depends on the split;
updated in ``on_step_end`` it happens once per global step.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.nn.modules.batchnorm import _NormBase

from ...memory.simulated import host_memory
from ...probe.snapshot.shards import local
from .step_guard import copy_all

__all__ = ["BufferGuard"]

log = logging.getLogger("autobatch")


class BufferGuard:
    """Host copies of ``model``'s buffers as of the start of the current global step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer  # its parameters are the step guard's; the others are watched here
        # (module, name) -> (a weak reference to the buffer, its version, the host copy) when last copied
        self._saved: dict[tuple[torch.nn.Module, str], tuple[weakref.ref, int, torch.Tensor]] = {}
        # parameters outside the optimizer: (module, name) -> (weak reference, version) at the step's start, not copied
        self._watched: dict[tuple[torch.nn.Module, str], tuple[weakref.ref, int]] = {}
        self._changing: set[tuple[torch.nn.Module, str]] = set()  # seen changed by a step: copied like buffers
        self._told = False

    def _buffers(self):
        """(module, name, buffer, unseen): ``unseen``, a buffer whose in-place updates the
        version counter does not see (a normalization layer's running statistics)."""
        for module in self.model.modules():
            unseen = isinstance(module, _NormBase)
            for name, buffer in module._buffers.items():
                if isinstance(buffer, torch.Tensor):
                    yield module, name, buffer, unseen
        for key in self._changing:
            parameter = key[0]._parameters.get(key[1])
            if isinstance(parameter, torch.Tensor):
                yield key[0], key[1], parameter, False

    def _loose(self):
        """(key, parameter) of every parameter ``optimizer`` does not train, not yet copied."""
        if self.optimizer is None:
            return
        trained = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        for module in self.model.modules():
            for name, parameter in module._parameters.items():
                if parameter is not None and id(parameter) not in trained and (module, name) not in self._changing:
                    yield (module, name), parameter

    def _moved(self) -> list[tuple[torch.nn.Module, str]]:
        """The watched parameters changed since the step's start."""
        return [key for key, parameter in self._loose()
                if key in self._watched and (self._watched[key][0]() is not parameter
                                             or self._watched[key][1] != _version(local(parameter)))]

    def settle(self) -> None:
        """End of a trained step: the watched parameters it changed are copied from now on."""
        moved = self._moved()
        if moved:
            self._changing.update(moved)
            self._tell(moved, kept=False)

    def _tell(self, moved: list[tuple[torch.nn.Module, str]], *, kept: bool) -> None:
        names = {id(module): prefix for prefix, module in self.model.named_modules()}
        listed = ", ".join(f"{names.get(id(module), '?')}.{name}".lstrip(".") for module, name in moved[:4])
        more = ", ..." if len(moved) > 4 else ""
        if kept:
            log.warning("parameters outside the optimizer (%s%s) were changed by the failed attempt's forward in the "
                        "first step that changed them, before any copy of them was kept: undoing that step (its replay, "
                        "or an error's undo) keeps that change (later steps' are undone); update them in "
                        "on_step_end(info) instead", listed, more)
        elif not self._told:
            log.warning("parameters outside the optimizer (%s%s) change in forward (a momentum or EMA update?): that "
                        "runs once per micro-batch, so it depends on the split (and on an OOM recovery's); update them "
                        "in on_step_end(info) to do it once per global step", listed, more)
        self._told = True

    @staticmethod
    def _changed(buffer: torch.Tensor, saved: tuple[weakref.ref, int, torch.Tensor] | None, unseen: bool) -> bool:
        return unseen or saved is None or saved[0]() is not buffer or saved[1] != _version(buffer)

    def capture(self) -> None:
        """Copy every buffer changed since its last copy (all of them, the first time), in one
        call (:func:`~autobatch.training.oom.step_guard.copy_all`; ResNet-50 has 159 BatchNorm buffers)."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        with torch.no_grad(), host_memory():
            for module, name, buffer, unseen in self._buffers():
                saved = self._saved.get((module, name))
                if not self._changed(buffer, saved, unseen):
                    continue
                part = local(buffer).detach()
                copy = saved[2] if saved is not None and saved[2].shape == part.shape and saved[2].dtype == part.dtype else None
                if copy is None:
                    pinned = part.device.type == "cuda"
                    copy = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=pinned)
                targets.append(copy)
                sources.append(part)
                self._saved[(module, name)] = (weakref.ref(buffer), _version(buffer), copy)
            if targets:
                copy_all(targets, sources)
            self._watched = {key: (weakref.ref(parameter), _version(local(parameter))) for key, parameter in self._loose()}

    def restore(self) -> None:
        """Write back every buffer (and copied parameter) changed since :meth:`capture`; a new
        one (none saved) stays, and a watched parameter changed without a copy is named."""
        moved = self._moved()
        if moved:
            self._changing.update(moved)
            self._tell(moved, kept=True)
        with torch.no_grad():
            for module, name, buffer, unseen in list(self._buffers()):
                saved = self._saved.get((module, name))
                if saved is None or not self._changed(buffer, saved, unseen):
                    continue
                restored = buffer
                if saved[0]() is buffer or isinstance(buffer, torch.nn.Parameter):  # a parameter: in place
                    local(buffer).copy_(saved[2])
                else:  # forward replaced the buffer object: put the old values back as a new tensor
                    restored = module._buffers[name] = saved[2].to(buffer.device, copy=True)
                self._saved[(module, name)] = (weakref.ref(restored), _version(restored), saved[2])


def _version(tensor: torch.Tensor) -> int:
    """The tensor's version counter; -1 for an inference tensor, which has none (and which
    nothing outside inference mode can change in place)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1
