"""A data loader that keeps its own batch size through the attempts of
:func:`~autobatch.integrations.decorator.find_executable_batch_size` (:class:`KeptLoader`).

Why: a loader ``accelerator.prepare``d outside the decorated function (Accelerate's
"dataloaders" gap) is the same object at every attempt, at the size it was built with, so no
retry trains a smaller batch. Where every attempt fails at one allocation the decorator stops
after four (``_fixed_failure``), but a shuffled loader of variable-length samples fails on another
allocation each time: 37 attempts down to batch 1, then ``NoBatchFitsError`` advising gradient
accumulation. A prepared loader is seen while it is iterated (Accelerate's ``GradientState``
lists it from its first batch until its loop ends), so the loader a failure happened in is known.
A plain ``DataLoader`` registers nowhere and is not seen.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from .decorator_state import gradient_state

__all__ = ["KeptLoader"]


class KeptLoader:
    """The prepared loader each failed attempt of one call was iterating, with its batch size. Made
    at the call's start: a loader whose loop was running then is the caller's (a decorated helper
    called mid-epoch), not one the function ignores its size for."""

    def __init__(self, name: str) -> None:
        self.name = name  # the decorated function's
        #: (loader, its batch size, the attempt's, the loops it had finished)
        self.failures: list[tuple[weakref.ref, int, int, Any]] = []
        self.message: str | None = None  # what was said (the warning's text after its prefix), once a call
        state = gradient_state()  # the caller's own loops (a helper called mid-epoch): not the function's
        self.outer = {id(loader) for loader in getattr(state, "dataloader_references", None) or () if loader is not None}

    def failed(self, size: int) -> None:
        """In a failed attempt's ``except`` handler (the loader's loop has not ended yet): where the
        same loader, at the same batch size, failed an earlier attempt of another size, and this
        attempt's size is not its own, :attr:`message` says it ignores the size, and is one
        ``RuntimeWarning`` (once a call)."""
        state = gradient_state()
        loader = getattr(state, "active_dataloader", None) if state is not None else None
        own = _batch_size(loader)
        if loader is None or own is None or id(loader) in self.outer:
            return
        for ref, was, tried, _ in self.failures:
            if self.message is None and ref() is loader and was == own and size not in (own, tried):
                self.message = (
                    f"`{self.name}` ran out of memory at batch {tried} and at batch {size} while "
                    f"iterating the same prepared data loader (batch_size={own}), not rebuilt for the new size: it "
                    "keeps its batch size whatever size the decorator passes, so no retry trains a smaller batch (and a "
                    f"size returned is not the one trained). {FIX}"
                )  # here, _record_failure, the decorator's loop, its wrapper: the caller's line
                warnings.warn(f"find_executable_batch_size: {self.message}", RuntimeWarning, stacklevel=5)
        try:
            self.failures.append((weakref.ref(loader), own, size, getattr(loader, "iteration", None)))
        except TypeError:  # not weakly referable: not followed
            pass

    def returned(self, size: int) -> None:
        """After the attempt that ran at ``size``: where a loader a failed attempt was iterating has
        finished a loop since (Accelerate's ``iteration`` counter), at its own batch size, not
        ``size``, one ``RuntimeWarning``: the call trained at the loader's size, and the size it
        returns (``wrapped.batch_size``, where a later call starts) is not that one."""
        for ref, own, tried, loops in self.failures if self.message is None else ():
            loader = ref()
            now = getattr(loader, "iteration", None)
            if (loader is not None and _batch_size(loader) == own != size and isinstance(now, int)
                    and isinstance(loops, int) and now > loops):
                self.message = (
                    f"`{self.name}` ran at batch {size}, but its loop was the prepared "
                    f"data loader with batch_size={own} that batch {tried} ran out of memory in, not rebuilt for the "
                    f"new size: it keeps its batch size whatever size the decorator passes: the call trained batches "
                    f"of {own}, and {size} is not the size that ran. {FIX}"
                )  # here, _returned, the decorator's loop, its wrapper: the caller's line
                warnings.warn(f"find_executable_batch_size: {self.message}", RuntimeWarning, stacklevel=5)
                return


#: what each message says to do
FIX = ("Build and prepare the loader inside the function: accelerator.prepare(DataLoader(dataset, "
       "batch_size=batch_size)) (unless the function splits each of its batches into chunks of batch_size).")


def _batch_size(loader: Any) -> int | None:
    """The batch size a loader yields (Accelerate's ``DataLoaderShard`` keeps it on its batch sampler)."""
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(holder, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None
