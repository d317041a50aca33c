"""autobatch's own exceptions."""

from __future__ import annotations

from .units import format_bytes

__all__ = ["NoBatchFitsError", "GlobalBatchTooLargeError", "StepOutOfMemoryError"]


class NoBatchFitsError(MemoryError):
    """Even the smallest batch the probe may try ran out of memory.

    A ``MemoryError`` so that ``except MemoryError`` catches it; it is deliberately *not* an
    OOM by :func:`~autobatch.is_oom_error`, so an outer retry loop does not mistake "nothing
    fits" for "try smaller". ``capacity_bytes``, ``peak_bytes`` and ``batch_size`` give the
    figures; ``result`` is the :class:`~autobatch.ProbeResult` with every trial made.
    ``diagnostics`` holds the device's memory figures (see
    :func:`~autobatch.diagnostics.memory_diagnostics`): the message gives allocated, reserved
    and the fragmentation gap in one line, ``diagnostics["memory_summary"]`` the full table.
    """

    def __init__(
        self,
        batch_size: int,
        capacity_bytes: int | None,
        peak_bytes: int | None,
        device: str,
        last_error: str | None = None,
        result=None,
        hint: str | None = None,
        diagnostics: dict | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.capacity_bytes = capacity_bytes
        self.peak_bytes = peak_bytes
        self.device = device
        self.last_error = last_error
        self.result = result
        self.diagnostics = diagnostics
        advice = hint or (
            "Try gradient accumulation with a smaller micro-batch (autobatch.plan), activation "
            "checkpointing, lower precision (bf16/fp16 autocast), a smaller model or sequence "
            "length, or a larger memory_limit / device."
        )
        memory_line = ""
        if diagnostics:
            from .diagnostics import diagnostics_line

            memory_line = diagnostics_line(diagnostics) + " "
        message = (
            f"No batch size fits: batch {batch_size} ran out of memory on {device} "
            f"(capacity {format_bytes(capacity_bytes)}, peak reached before the failure "
            f"{format_bytes(peak_bytes)}). {memory_line}{advice}"
        )
        if last_error:
            message += f" Last allocator error: {last_error}"
        super().__init__(message)


class GlobalBatchTooLargeError(MemoryError):
    """The global batch does not fit in one step and gradient accumulation was not allowed.

    ``largest_fit`` is the largest batch that trained (with activation checkpointing when
    ``checkpointing`` is true); ``global_batch`` what was asked for.
    """

    def __init__(self, global_batch: int, largest_fit: int, checkpointing: bool, device: str) -> None:
        self.global_batch = global_batch
        self.largest_fit = largest_fit
        self.checkpointing = checkpointing
        self.device = device
        how = "with activation checkpointing" if checkpointing else "without activation checkpointing"
        super().__init__(
            f"global_batch={global_batch} does not fit in one step on {device}: the largest batch "
            f"that trains {how} is {largest_fit}. Allow gradient accumulation "
            "(allow_accumulation=True) to keep the global batch in several micro-batches"
            + ("" if checkpointing else ", or allow activation checkpointing")
            + "."
        )


class StepOutOfMemoryError(MemoryError):
    """The training runner could not fit a global step even at micro-batch 1.

    Raised ``from`` the last out-of-memory error. ``step`` is the global step index,
    ``phase`` where the last attempt failed, ``checkpointing`` whether activation
    checkpointing was on by then. Not an OOM by :func:`~autobatch.is_oom_error`, so no outer
    retry loop mistakes it for "try smaller".
    """

    def __init__(self, step: int, phase: str, checkpointing: bool, reason: str | None = None) -> None:
        self.step = step
        self.phase = phase
        self.checkpointing = checkpointing
        how = "with activation checkpointing" if checkpointing else "without activation checkpointing"
        message = reason or (
            f"global step {step} ran out of memory in {phase} at micro-batch 1 {how}; nothing smaller "
            "is left to try. "
            + ("" if checkpointing else "Enable checkpointing_fallback=True, or try ")
            + "lower precision, a smaller model or sequence length, or more device memory."
        )
        super().__init__(message)
