"""Stage a snapshot's weights on the device, so the probe never waits for a host copy.

A :class:`~autobatch.probe.restore.Snapshot` keeps the weights a probe restores. Copying them
to host memory is slow (measured on an H200 host: 0.2-0.5 s for a ViT-B/16 or GPT-2 small,
~0.7-1.8 GB/s into fresh host memory), and the first trial's optimizer step had to wait for
it. :class:`DeviceStage` copies parameters and optimizer state into one device buffer instead,
queued on the current stream before the first trial (so no optimizer step can overwrite them
first, and nothing waits); :class:`StagedCopy` copies that buffer to host memory in a thread
while the trials run, and the restore copies back from the device buffer when it still exists.

The buffer sits in device memory while trials run, so the trials beside it
(:class:`~autobatch.probe.trial.TrialRunner`) subtract its bytes from their figures, exactly:
it is one allocation of whole 2 MiB pages in a segment of its own. A trial that runs out of
memory beside it runs again once it is freed, unless its own figures prove it fails without it.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..memory.oom import is_oom_error
from .shards import is_dtensor

__all__ = ["DeviceStage", "StagedCopy", "STAGE_MIN_BYTES", "STAGE_MAX_BYTES", "STAGE_FRACTION"]

log = logging.getLogger("autobatch")

STAGE_MIN_BYTES = 16 * 2**20  # below this the host copy is quick (<10 ms): not worth a buffer
STAGE_FRACTION = 0.1  # the buffer may take at most this fraction of the probe's capacity
STAGE_MAX_BYTES = 4 * 2**30  # and at most this much (its host copy is page-locked memory)
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
        if size < STAGE_MIN_BYTES or size > min(limit, STAGE_MAX_BYTES):
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
            torch._foreach_copy_(stage.views(buffer), [tensor.detach() for tensor in tensors])
        stage._event.record(torch.cuda.current_stream(device))
        return stage

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The staged tensors as views of ``flat`` (the device buffer, or its host copy)."""
        return [flat[offset:offset + nbytes].view(dtype).view(shape) for offset, nbytes, dtype, shape in self._layout]


class StagedCopy:
    """A :class:`DeviceStage` of parameters and optimizer state, copied to host memory by a
    thread while the probe runs, and handed back by :meth:`copies` for the restore.

    The restore takes the device buffer while it exists (a device-to-device copy, no wait) and
    abandons the host copy; the host copy is what lets :meth:`wait` free the buffer before
    that (a trial that failed beside it runs again without it). The host buffer is page-locked,
    so the device's part of the copy is one DMA on a side stream and the slow part, locking
    fresh host pages, is host work that leaves the device alone (a pageable copy, where
    page-locked memory is refused, holds the device for the whole copy: ~1.5 GB/s measured on
    an H200 host). The page-locked block stays in PyTorch's host cache for reuse."""

    def __init__(self, stage: DeviceStage, names: list[str], template: Any) -> None:
        self.stage, self.names, self.template = stage, names, template
        self._lock = threading.Lock()
        self._abandoned = False
        self._host: list[torch.Tensor] | None = None
        self._thread = threading.Thread(target=self._copy, name="autobatch-snapshot", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, params: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer, limit: int) -> "StagedCopy | None":
        """Stage ``params`` and ``optimizer``'s state (None when they do not qualify)."""
        tensors = [param for _, param in params]
        template = split_state(optimizer.state_dict(), tensors)
        stage = None if template is None else DeviceStage.create(tensors, limit)
        return None if stage is None else cls(stage, [name for name, _ in params], template)

    def _copy(self) -> None:
        try:
            try:
                host = torch.empty(self.stage.nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:  # page-locked memory is limited (ulimit -l, containers)
                log.debug("snapshot: no page-locked buffer (%s); copying through pageable memory", exc)
                host = None
            with self._lock:  # the buffer, unless the restore took it meanwhile
                buffer = None if self._abandoned else self.stage.buffer
                if buffer is None:
                    return
                side = torch.cuda.Stream(device=buffer.device)
                side.wait_event(self.stage._event)
                buffer.record_stream(side)  # freed by the restore while copied: reused only after
            with torch.cuda.stream(side):
                if host is None:
                    host = buffer.to("cpu")
                else:
                    host.copy_(buffer, non_blocking=True)
            side.synchronize()
            with self._lock:
                if not self._abandoned:
                    self._host = self.stage.views(host)
        except Exception as exc:  # noqa: BLE001 - the device buffer still holds every value
            log.warning("autobatch kept the probe's snapshot on the device: copying it to host memory failed (%s)", exc)

    def held_bytes(self) -> int:
        """Device bytes the buffer holds now (0 once freed)."""
        return 0 if self.stage.buffer is None else self.stage.nbytes

    def done(self) -> bool:
        """Whether the host copy has finished (or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the host copy; free the device buffer once the copy exists (kept otherwise)."""
        self._thread.join()
        with self._lock:
            if self._host is not None:
                self.stage.buffer = None

    def copies(self) -> tuple[dict[str, torch.Tensor], Any]:
        """(parameters by name, optimizer ``state_dict``) for the restore: views of the device
        buffer while it exists (the host copy is then abandoned), else of the host copy."""
        with self._lock:
            self._abandoned = True
            buffer, self.stage.buffer = self.stage.buffer, None
            host = self._host
        source = self.stage.views(buffer) if buffer is not None else host
        if source is None:  # unreachable: the buffer is freed only once the host copy exists
            raise RuntimeError("autobatch lost the probe's snapshot: neither the device buffer nor its host copy exists")
        return dict(zip(self.names, source)), fill_state(self.template, source[len(self.names):])


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
