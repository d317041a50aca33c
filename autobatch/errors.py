"""autobatch's own exceptions, and the frames an error passed through (where a user's error came from)."""

from __future__ import annotations

import torch

from .memory.units import format_bytes

__all__ = [
    "NoBatchFitsError",
    "GlobalBatchTooLargeError",
    "StepOutOfMemoryError",
    "RankDisagreementError",
    "PeerOutOfMemoryError",
    "PeerFailedError",
    "CheckpointError",
    "FakeTensorLeakError",
    "AccumulationBrokenError",
    "raised_through",
    "in_packages",
    "add_note",
]


class NoBatchFitsError(MemoryError):
    """Even the smallest batch the probe may try ran out of memory.

    A ``MemoryError`` so that ``except MemoryError`` catches it; it is deliberately *not* an
    OOM by :func:`~autobatch.is_oom_error`, so an outer retry loop does not mistake "nothing
    fits" for "try smaller". ``capacity_bytes``, ``peak_bytes`` and ``batch_size`` give the
    figures; ``result`` is the :class:`~autobatch.ProbeResult` with every trial made.
    ``diagnostics`` holds the device's memory figures (see
    :func:`~autobatch.memory.diagnostics.memory_diagnostics`): the message gives allocated, reserved
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
        estimated: bool = False,
    ) -> None:
        self.batch_size = batch_size
        self.capacity_bytes = capacity_bytes
        self.peak_bytes = peak_bytes
        self.device = device
        self.last_error = last_error
        self.result = result
        self.diagnostics = diagnostics
        if hint:
            advice = hint
        elif batch_size == 1:  # no micro-batch is smaller: accumulation alone cannot help
            advice = (
                "Batch 1 is the smallest micro-batch, so gradient accumulation alone cannot help; try activation "
                "checkpointing (autobatch.enable_checkpointing; a plan turns it on where batch 1 does not fit), "
                "lower precision (bf16/fp16 autocast), a smaller model or sequence length, or a larger memory_limit "
                "/ device."
            )
        else:
            advice = (
                "Try gradient accumulation with a smaller micro-batch (autobatch.plan), activation "
                "checkpointing, lower precision (bf16/fp16 autocast), a smaller model or sequence "
                "length, or a larger memory_limit / device."
            )
        memory_line = ""
        if diagnostics:
            from .memory.diagnostics import diagnostics_line

            memory_line = diagnostics_line(diagnostics) + " "
        if estimated:  # strategy="estimate": traced with fake tensors, nothing ran
            message = (
                f"No batch size fits: batch {batch_size} is estimated to peak at {format_bytes(peak_bytes)} on "
                f"{device}, above its capacity of {format_bytes(capacity_bytes)} (fake tensors, no trial ran). {advice}"
            )
        else:
            message = (
                f"No batch size fits: batch {batch_size} ran out of memory on {device} "
                f"(capacity {format_bytes(capacity_bytes)}, peak reached before the failure "
                f"{format_bytes(peak_bytes)}). {memory_line}{advice}"
            )
        if last_error and not estimated:
            message += f" Last allocator error: {last_error}"
        super().__init__(message)


class GlobalBatchTooLargeError(MemoryError):
    """The global batch does not fit in one step and gradient accumulation was not allowed.

    ``largest_fit`` is the largest batch that trained (with activation checkpointing when
    ``checkpointing`` is true); ``global_batch`` what was asked for.
    """

    def __init__(self, global_batch: int, largest_fit: int, checkpointing: bool, device: str,
                 checkpointing_unavailable: str | None = None) -> None:
        self.global_batch = global_batch
        self.largest_fit = largest_fit
        self.checkpointing = checkpointing
        self.device = device
        how = "with activation checkpointing" if checkpointing else "without activation checkpointing"
        if checkpointing or checkpointing_unavailable:  # allowed: say why it did not help, not to allow it
            other = f"; activation checkpointing could not help: {checkpointing_unavailable}" if checkpointing_unavailable else ""
        else:
            other = ", or allow activation checkpointing"
        super().__init__(
            f"global_batch={global_batch} does not fit in one step on {device}: the largest batch "
            f"that trains {how} is {largest_fit}. Allow gradient accumulation "
            f"(allow_accumulation=True) to keep the global batch in several micro-batches{other}."
        )


class StepOutOfMemoryError(MemoryError):
    """The training runner could not fit a global step even at micro-batch 1 (or at the smallest
    ``min_micro_batch`` allows), or ``optimizer.step()`` ran out of memory again after its replays at
    the same micro-batch (``phase="optimizer"``), or an OOM struck after the step's attempts had succeeded, outside
    the replay (``phase="scheduler"``: in ``scheduler.step()``, which no smaller micro-batch shrinks).

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
        if phase == "optimizer":  # checkpointing shrinks activations, not the optimizer's step
            advice = ("The optimizer step itself does not fit: try an optimizer with less state (SGD, Adafactor), "
                      "lower precision, a smaller model, or more device memory.")
        else:
            advice = (("Try " if checkpointing else "Enable checkpointing_fallback=True, or try ")
                      + "lower precision, a smaller model or sequence length, or more device memory.")
        message = reason or (
            f"global step {step} ran out of memory in {phase} at micro-batch 1 {how}; nothing smaller "
            "is left to try. " + advice
        )
        super().__init__(message)


class RankDisagreementError(RuntimeError):
    """Under ``torch.distributed``, the ranks did not meet at the same sync point in time.

    Raised instead of hanging: a rank did not arrive within the sync timeout, reached a
    different sync point, or died. ``rank`` is this rank, ``waiting_at`` the sync point it was
    at, ``doing`` what each rank was last doing (from the process group's store). Not an OOM,
    so no retry loop replays it.
    """

    #: it may quote another rank's words: never an OOM of this rank, whatever they say (is_oom_error)
    quotes_peers = True

    def __init__(self, rank: int, waiting_at: str, doing: dict[int, str], reason: str) -> None:
        self.rank = rank
        self.waiting_at = waiting_at
        self.doing = dict(doing)
        self.reason = reason
        ranks = "; ".join(f"rank {other}: {what}" for other, what in sorted(self.doing.items()))
        super().__init__(
            f"rank {rank} waited at sync point {waiting_at!r} but {reason}. Last sync point per rank: "
            f"{ranks or 'unknown'}. Every rank must run the same autobatch calls in the same order "
            "(AUTOBATCH_SYNC_TIMEOUT sets the wait)."
        )


class PeerOutOfMemoryError(torch.OutOfMemoryError):
    """Another rank ran out of memory, so this rank replays the step with it.

    An OOM by :func:`~autobatch.is_oom_error` on purpose: the rank that did *not* run out of
    memory takes the same recovery path as the one that did. ``phase`` is where the first
    failing rank's error struck, ``ranks`` the ranks that failed.
    """

    def __init__(self, message: str, phase: str, ranks: list[int]) -> None:
        self.phase = phase
        self.ranks = ranks
        super().__init__(message)


class PeerFailedError(RuntimeError):
    """Another rank raised an error that is not an OOM; this rank stops too instead of waiting.

    ``ranks`` lists the failed ranks; their own logs hold the original exception.
    """

    #: its message quotes the failed rank's error: never an OOM of this rank, even where that error's
    #: words are an allocator's (is_oom_error; the peer's replay would wait for a rank that left)
    quotes_peers = True

    def __init__(self, message: str, ranks: list[int]) -> None:
        self.ranks = ranks
        super().__init__(message)


class CheckpointError(ValueError):
    """A checkpoint that autobatch will not resume from: not ours, truncated, holding code, or
    from another model. ``path`` is the file; the message says what to do."""

    def __init__(self, path, problem: str) -> None:
        self.path = path
        super().__init__(f"cannot resume from {path}: {problem}")


class UnevenDataError(ValueError):
    """The ranks' data yield different numbers of batches per epoch (an unevenly sharded
    dataset); raised on every rank before they would pair batches across epochs."""


class FakeTensorLeakError(RuntimeError):
    """A training step computed with a fake tensor (shape, no data) outside any fake-tensor trace.

    A trace (autobatch's estimate: ``strategy="estimate"``, ``auto``'s first trial on the CPU,
    ``estimate_max_batch``) puts back everything of the user's it can reach; a fake it could not
    (kept in a cache it cannot see) would have the step train on tensors without data, and the
    probe answer and cache sizes it never ran. Not an OOM: no search or retry goes on past it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} is a FakeTensor (a shape without data) outside any fake-tensor trace: the step computed with a "
            "fake tensor that an estimate's trace (strategy='estimate', 'auto' on the CPU, estimate_max_batch) left "
            "in a cache of yours it could not put back, so it would train on no data and measure nothing. Rebuild "
            "that cache (clear it, or start a new process); keep such caches as module attributes or buffers, which "
            "the trace puts back; or probe without tracing: strategy='predict' or 'binary' (or estimate_first=False)"
        )


class AccumulationBrokenError(RuntimeError):
    """``loss_fn`` zeroed the gradients the runner was accumulating over a step's micro-batches,
    or stepped a scheduler (changed the learning rate) there, once per micro-batch.

    Raised by the :class:`~autobatch.Runner` at the first step trained in more than one piece (a
    plan's accumulation, a replay after an OOM), the step undone as after any error; the message
    names the call to remove from ``loss_fn``. Not an OOM: no replay follows it."""


def in_packages(module: str, packages: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``packages`` or a module under one (``torch.nn`` is in ``torch``)."""
    return any(module == name or module.startswith(name + ".") for name in packages)


def raised_through(exc: BaseException, *, leaving: tuple[str, ...] = ()) -> list[tuple[str, str, int, str]]:
    """``(module, file, line, function)`` of each frame ``exc`` passed through, innermost last,
    without those of the packages in ``leaving``: where a user's error came from (the fake-tensor
    estimate's message, the command line's), past the frames of torch and autobatch."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        code, module = tb.tb_frame.f_code, str(tb.tb_frame.f_globals.get("__name__", ""))
        if not in_packages(module, leaving):
            frames.append((module, code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return frames


def add_note(exc: BaseException, note: str) -> BaseException:
    """``exc`` with ``note`` added (autobatch's advice on a user's error: which size failed, what
    to set). ``BaseException.add_note`` exists from Python 3.11; on 3.10, which autobatch
    supports, calling it raised ``AttributeError`` and hid the user's own error. There the same
    ``__notes__`` list is set: the command line's one-line error reads it (3.10's tracebacks do
    not print it)."""
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
    else:  # Python 3.10
        exc.__notes__ = [*(getattr(exc, "__notes__", None) or ()), note]
    return exc
