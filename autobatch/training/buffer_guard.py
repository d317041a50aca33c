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
changes is copied once. The normalization layers' running statistics are copied every step:
the batch-norm kernels update them in place without bumping the counter (torch 2.13, CPU). So
a step copies only what forward changes (ResNet-50: its BatchNorm statistics, 0.2 MiB), into
host memory, which the device's budget (the probed maximum) never pays for.
:meth:`BufferGuard.restore`, at the top of a replay, writes back every buffer changed since: in
place, or by putting the saved tensor back where forward replaced the buffer object.
A write through ``.data`` bypasses the version counter and is not seen.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _NormBase

from ..memory.simulated import host_memory
from ..probe.shards import local
from .step_guard import copy_all

__all__ = ["BufferGuard"]


class BufferGuard:
    """Host copies of ``model``'s buffers as of the start of the current global step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # (module, name) -> (the buffer's id, its version, the host copy) when last copied
        self._saved: dict[tuple[torch.nn.Module, str], tuple[int, int, torch.Tensor]] = {}

    def _buffers(self):
        """(module, name, buffer, unseen): ``unseen``, a buffer whose in-place updates the
        version counter does not see (a normalization layer's running statistics)."""
        for module in self.model.modules():
            unseen = isinstance(module, _NormBase)
            for name, buffer in module._buffers.items():
                if isinstance(buffer, torch.Tensor):
                    yield module, name, buffer, unseen

    @staticmethod
    def _changed(buffer: torch.Tensor, saved: tuple[int, int, torch.Tensor] | None, unseen: bool) -> bool:
        return unseen or saved is None or saved[0] != id(buffer) or saved[1] != _version(buffer)

    def capture(self) -> None:
        """Copy every buffer changed since its last copy (all of them, the first time), in one
        call (:func:`~autobatch.training.step_guard.copy_all`; ResNet-50 has 159 BatchNorm buffers)."""
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
                self._saved[(module, name)] = (id(buffer), _version(buffer), copy)
            if targets:
                copy_all(targets, sources)

    def restore(self) -> None:
        """Write back every buffer changed since :meth:`capture`; a new one (none saved) stays."""
        with torch.no_grad():
            for module, name, buffer, unseen in list(self._buffers()):
                saved = self._saved.get((module, name))
                if saved is None or not self._changed(buffer, saved, unseen):
                    continue
                if saved[0] == id(buffer):
                    local(buffer).copy_(saved[2])
                else:  # forward replaced the buffer object: put the old values back as a new tensor
                    module._buffers[name] = saved[2].to(buffer.device, copy=True)
                restored = module._buffers[name]
                self._saved[(module, name)] = (id(restored), _version(restored), saved[2])


def _version(tensor: torch.Tensor) -> int:
    """The tensor's version counter; -1 for an inference tensor, which has none (and which
    nothing outside inference mode can change in place)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1
