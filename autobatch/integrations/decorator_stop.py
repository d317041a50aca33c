"""How a call of :func:`~autobatch.integrations.decorator.find_executable_batch_size` ends when
no smaller size can help: :func:`fixed_failure` tells whether the call's failed attempts ran out of
memory at one point whatever their size, and :func:`nothing_fits` builds the
:class:`~autobatch.NoBatchFitsError` that says why, and what to change.

Split from :mod:`.decorator` (which calls both) so that module keeps to the search itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..errors import NoBatchFitsError
from ..memory.devices import DeviceMemory
from .decorator_checks import kept_by_failures
from .decorator_fixed import fixed_hint, fixed_point

if TYPE_CHECKING:
    from .decorator import Attempt

__all__ = ["fixed_failure", "nothing_fits"]


def fixed_failure(attempts: list[Attempt]) -> str | None:
    """Whether a call's failed attempts ran out of memory at one point whatever their size: the
    same allocator message (the same request, the same memory in use), and where measured the same
    bytes allocated above each attempt's start, over sizes at least a factor 2 apart. None when
    not; "stop" when at least 4 did, each after allocating something (an OOM raised by hand
    allocates nothing), over sizes at least a factor 4 apart, so no smaller size can get past that
    point either; "same" when they did but that is not proof enough to stop. Why: a function that
    ignores its batch size (a ``DataLoader`` built outside it, with its own ``batch_size``) failed
    identically 39 times from 2048 down to 1, then raised ``NoBatchFitsError`` advising gradient
    accumulation. Why a factor 4 to stop: a function that does use its size but fills the memory
    in pieces of one size (a tensor per sample) fails at the capacity on the same request whatever
    the size, too; started at 3x what fits, a factor 2 stopped it at 347 where 256 ran."""
    failed = [attempt for attempt in attempts if not attempt.ok]
    if len(failed) < 2 or failed[0].requested_bytes is None or failed[0].batch_size < 2 * failed[-1].batch_size:
        return None

    def point(attempt: Attempt) -> tuple:
        grew = (None if attempt.failed_at_bytes is None or attempt.start_bytes is None
                else attempt.failed_at_bytes - attempt.start_bytes)
        return attempt.error, attempt.requested_bytes, grew

    if any(point(attempt) != point(failed[0]) for attempt in failed):
        return None
    grew = point(failed[0])[2]
    spans = failed[0].batch_size >= 4 * failed[-1].batch_size
    return "stop" if spans and len(failed) >= 4 and grew is not None and grew > 0 else "same"


def nothing_fits(attempt: Attempt, memory: DeviceMemory | None, attempts: list[Attempt],
                  function: Callable[..., Any], instance: Any = None, loader: str | None = None) -> NoBatchFitsError:
    """Batch 1 failed, or this call's ``attempts`` all failed at one point whatever their size
    (:func:`fixed_failure`), so a smaller one would too: the error says which, and what to change.
    ``instance``: a method's ``self``, whose own ``batch_size`` attribute (Lightning's convention)
    is named where the size looks ignored: a method that read it never used the size it was given.
    ``loader``: :class:`~.decorator_loaders.KeptLoader`'s message, where a prepared loader ignored it
    (said before the fixed point's hint, whose advice, a loader built outside, is wrong for a Trainer's)."""
    name, fixed = getattr(function, "__name__", "function"), attempts if fixed_failure(attempts) else None
    own = getattr(instance, "batch_size", None) if instance is not None else None
    if loader is not None:  # it names the loader that kept its size: more than "the same point" says
        hint = f"find_executable_batch_size reached batch {attempt.batch_size}. {loader}"
    elif fixed:
        hint = (
            f"find_executable_batch_size stopped at batch {attempt.batch_size}: every attempt of `{name}` from batch "
            f"{fixed[0].batch_size} down to {attempt.batch_size} ({len(fixed)} attempts) ran out of memory at the same "
            "point (the same allocation, with the same memory in use), so what fails does not depend on the batch "
            f"size. Does `{name}` use the batch size it is given?"
            + (f" `self.batch_size` is {own}, and the decorator does not set it: read the method's batch_size "
               "parameter instead." if isinstance(own, int) and not isinstance(own, bool) else "")
            + " A DataLoader built outside the function keeps its "
            "own batch_size: build it inside, DataLoader(dataset, batch_size=batch_size). If it does, what fails is "
            "fixed in size (the model, its optimizer state, a fixed-size buffer): use lower precision, a smaller "
            "model or a larger device."
        )
    elif kept := kept_by_failures(name, attempts):
        hint = f"find_executable_batch_size reached batch {attempt.batch_size}. {kept}"
    elif (point := fixed_point(attempts)) is not None:  # the fixed part alone does not fit
        hint = fixed_hint(name, point)
    else:
        hint = ("find_executable_batch_size reached batch 1 and it still ran out of memory, so no smaller batch (nor "
                "gradient accumulation) can help: use activation checkpointing, lower precision, a smaller model or a larger device.")
    return NoBatchFitsError(
        batch_size=attempt.batch_size, capacity_bytes=attempt.capacity_bytes,
        peak_bytes=None if memory is None else memory.peak(), device=getattr(memory, "name", "the device"),
        last_error=attempt.error, hint=hint,
    )
