"""Stage a snapshot's weights on the device, so the probe never waits for the host copy.

A :class:`~autobatch.probe.restore.Snapshot` keeps the weights a probe restores in host
memory. Copying them there is slow (measured on an H200: ~0.7-1.8 GB/s into fresh host
memory, 0.2-0.5 s for a ViT-B/16 or GPT-2 small), and the first trial's optimizer step had to
wait for it. :class:`DeviceStage` instead copies parameters and optimizer state into one device
buffer, queued on the current stream before the first trial (so the trial's optimizer step,
queued later, cannot overwrite them first: no host wait), and a thread copies that buffer to
host memory while the trials run.

The buffer sits in device memory while trials run, so the trials that run beside it
(:class:`~autobatch.probe.trial.TrialRunner`) subtract its bytes from their figures, exactly:
it is one allocation of whole 2 MiB pages in a segment of its own. A trial that fails beside it
runs again once the buffer is gone, and the answer's confirmation never runs beside it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..memory.oom import is_oom_error
from .shards import is_dtensor

__all__ = ["DeviceStage", "STAGE_MIN_BYTES", "STAGE_FRACTION"]

log = logging.getLogger("autobatch")

STAGE_MIN_BYTES = 16 * 2**20  # below this the host copy is quick (<10 ms): not worth a buffer
STAGE_FRACTION = 0.25  # the buffer may take at most this fraction of the probe's capacity
_ALIGN = 512  # every tensor's offset in the buffer: aligned for any dtype
_PAGE = 2 * 2**20  # the caching allocator's large-segment rounding: the buffer fills its segment


@dataclass
class _Slot:
    """Where a staged tensor of an optimizer ``state_dict`` goes back (its index)."""

    index: int


class DeviceStage:
    """Tensors copied into one device buffer (:meth:`create`), then to host memory (:meth:`to_host`)."""

    def __init__(self, buffer: torch.Tensor, layout: list[tuple[int, int, torch.dtype, torch.Size]], event: Any) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.nbytes = buffer.numel()
        self._layout = layout
        self._event = event

    @classmethod
    def create(cls, tensors: list[torch.Tensor], limit: int) -> "DeviceStage | None":
        """Stage ``tensors`` (all on one CUDA device, none sharded) in one buffer of at most
        ``limit`` bytes; None when they do not qualify, are too small to be worth it, or the
        buffer does not fit."""
        devices = {tensor.device for tensor in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda" or any(is_dtensor(t) for t in tensors):
            return None
        layout, offset = [], 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            layout.append((offset, nbytes, tensor.dtype, tensor.shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        size = -(-offset // _PAGE) * _PAGE
        if size < STAGE_MIN_BYTES or size > limit:
            return None
        device = next(iter(devices))
        torch.cuda.empty_cache()  # a segment of its own, so its bytes are exactly what trials subtract
        try:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        except Exception as exc:  # noqa: BLE001 - no room for it: the snapshot copies directly
            if not is_oom_error(exc):
                raise
            return None
        stage = cls(buffer, layout, torch.cuda.Event())
        with torch.no_grad():
            torch._foreach_copy_(stage._views(buffer), [tensor.detach() for tensor in tensors])
        stage._event.record(torch.cuda.current_stream(device))
        return stage

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[offset:offset + nbytes].view(dtype).view(shape) for offset, nbytes, dtype, shape in self._layout]

    def to_host(self) -> list[torch.Tensor]:
        """The staged tensors in host memory (views of one host buffer); called from the
        snapshot's thread. The host buffer is page-locked, so the device's part is one DMA on a
        side stream (tens of ms for GPT-2's weights) and the slow part, locking fresh host pages,
        is host work that leaves the device alone: a probe's device-wide synchronisations (each
        trial's ``empty_cache``) then never wait for it. Where page-locked memory is refused,
        a pageable copy (the driver stages it; ~1.5 GB/s on an H200 host)."""
        assert self.buffer is not None
        side = torch.cuda.Stream(device=self.buffer.device)
        try:
            host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # page-locked memory is limited (ulimit -l, containers)
            log.debug("snapshot: no page-locked buffer (%s); copying through pageable memory", exc)
            host = None
        side.wait_event(self._event)
        with torch.cuda.stream(side):
            if host is None:
                host = self.buffer.to("cpu")
            else:
                host.copy_(self.buffer, non_blocking=True)
        side.synchronize()
        return self._views(host)

    def on_device(self) -> list[torch.Tensor]:
        """The staged tensors as views of the device buffer (when the host copy failed)."""
        assert self.buffer is not None
        return self._views(self.buffer)

    def release(self) -> None:
        """Free the device buffer (after the host copy is complete)."""
        self.buffer = None


def split_state(state: Any, staged: list[torch.Tensor]) -> Any:
    """An optimizer ``state_dict`` with each plain CUDA tensor appended to ``staged`` and
    replaced by its :class:`_Slot`; other tensors copied to the CPU, other leaves deep-copied.
    None when a ``DTensor`` is in it (sharded state is snapshotted as before)."""
    found_dtensor = False

    def walk(value: Any) -> Any:
        nonlocal found_dtensor
        if is_dtensor(value):
            found_dtensor = True
            return None
        if isinstance(value, torch.Tensor):
            if value.device.type == "cuda":
                staged.append(value)
                return _Slot(len(staged) - 1)
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return copy.deepcopy(value)

    template = walk(state)
    return None if found_dtensor else template


def fill_state(template: Any, tensors: list[torch.Tensor]) -> Any:
    """:func:`split_state`'s template with each slot replaced by its tensor."""
    if isinstance(template, _Slot):
        return tensors[template.index]
    if isinstance(template, dict):
        return {key: fill_state(item, tensors) for key, item in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(fill_state(item, tensors) for item in template)
    return template
