"""A data loader that keeps its own batch size through the attempts of
:func:`~autobatch.integrations.decorator.find_executable_batch_size` (:class:`KeptLoader`).

Why: a loader ``accelerator.prepare``d outside the decorated function (Accelerate's
"dataloaders" gap) is the same object at every attempt, at the size it was built with, so no
retry trains a smaller batch. Where every attempt fails at one allocation the decorator stops
after four (``decorator_stop.fixed_failure``), but a shuffled loader of variable-length samples fails on another
allocation each time: 37 attempts down to batch 1, then ``NoBatchFitsError`` advising gradient
accumulation. A prepared loader is seen while it is iterated (Accelerate's ``GradientState``
lists it from its first batch until its loop ends), so the loader a failure happened in is known.
A plain ``DataLoader`` registers nowhere and is not seen.

A ``transformers.Trainer``'s ``train()`` called in the function (a user migrating from Accelerate's
decorator sets ``trainer.args.per_device_train_batch_size = batch_size`` first) rebuilds its loader
at every attempt, but at ``trainer._train_batch_size``, copied when the Trainer was constructed:
every attempt trained the same batch, and the error said to build the loader inside the function,
where ``train()`` builds it. Two failed attempts of other sizes through a Trainer whose loader had
one batch size name it, and ``fit_batch_size``. And a one-shot iterator made outside (passed in, or
read as a global, a closure variable or ``self``'s attribute), which each retry goes on reading where the
failed attempt stopped (:class:`DrawnIterators`).
"""

from __future__ import annotations

import inspect
import operator
import sys
import warnings
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from ..probe.tracing.trace_state import closure_cells, nested_codes
from .decorator_accelerate import gradient_state

__all__ = ["KeptLoader"]


class KeptLoader:
    """The prepared loader each failed attempt of one call was iterating, with its batch size. Made
    at the call's start: a loader whose loop was running then is the caller's (a decorated helper
    called mid-epoch), not one the function ignores its size for."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                 function: Any = None, instance: Any = None) -> None:
        self.name = name  # the decorated function's
        # the call's arguments (a method's without self), and what the function reads from outside
        self.drawn = DrawnIterators(name, args, kwargs or {}, function, instance)
        #: (loader, its batch size, the attempt's, the loops it had finished)
        self.failures: list[tuple[weakref.ref, int, int, Any]] = []
        self.message: str | None = None  # what was said (the warning's text after its prefix), once a call
        state = gradient_state()  # the caller's own loops (a helper called mid-epoch): not the function's
        self.outer = {id(loader) for loader in getattr(state, "dataloader_references", None) or () if loader is not None}

    def failed(self, size: int) -> None:
        """In a failed attempt's ``except`` handler (the loader's loop has not ended yet): where the
        same loader, at the same batch size, failed an earlier attempt of another size, and this
        attempt's size is not its own, :attr:`message` says it ignores the size, and is one
        ``RuntimeWarning`` (once a call). An iterator argument it drew from is one too (:class:`DrawnIterators`)."""
        self.drawn.failed(size)
        state = gradient_state()
        loader = getattr(state, "active_dataloader", None) if state is not None else None
        own = _batch_size(loader)
        if loader is None or own is None or id(loader) in self.outer:
            return
        trainer = _trainer_in(sys.exc_info()[2])
        for ref, was, tried, _ in self.failures:
            if self.message is None and trainer is not None and was == own and size not in (own, tried):
                self.message = (  # its loader is rebuilt at every train(), always at the constructor's size
                    f"`{self.name}` ran out of memory at batch {tried} and at batch {size} inside "
                    f"{type(trainer).__name__}.train(), whose data loader had batch_size={own} both times: a "
                    "transformers Trainer copies per_device_train_batch_size into trainer._train_batch_size when "
                    "it is constructed and train() builds its loader at that, so setting trainer.args in the "
                    "function changes nothing and no retry trains a smaller batch. Call "
                    "autobatch.integrations.transformers.fit_batch_size(trainer) before trainer.train() instead of "
                    "the decorator (or construct the Trainer inside the function)."
                )
            elif self.message is None and ref() is loader and was == own and size not in (own, tried):
                self.message = (
                    f"`{self.name}` ran out of memory at batch {tried} and at batch {size} while "
                    f"iterating the same prepared data loader (batch_size={own}), not rebuilt for the new size: it "
                    "keeps its batch size whatever size the decorator passes, so no retry trains a smaller batch (and a "
                    f"size returned is not the one trained). {FIX}"
                )
            else:
                continue
            # here, _record_failure, the decorator's loop, its wrapper: the caller's line
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


class DrawnIterators:
    """The one-shot iterators a call reads from outside, and whether a failed attempt drew from them.

    Why: each retry runs the function from its top, but an iterator made outside it (``iter(samples)``,
    a generator of batches, ``iter(loader)``) goes on where the failed attempt stopped, so what the
    failed attempts drew is never trained, silently (40 samples, attempts at 8 and 7 failing after one
    batch each: 25 trained). A drawn one is one ``RuntimeWarning`` a call. Looked for among the call's
    arguments, and (where the function reads it instead: a global, a variable of the enclosing
    function, ``self.data_iter``, which were never warned) among the globals its code names, its
    closure's cells and a method's instance attributes. Seen only where drawing shows: a generator
    not started at the call's start, a ``DataLoader``'s iterator (its count of batches yielded; its
    length hint is the loader's length, which never falls), or an iterator whose ``length_hint`` fell
    (a list's, a range's); a re-iterable (a list, a ``Dataset``, a ``DataLoader``) is read again by each attempt."""

    def __init__(self, name: str, args: tuple, kwargs: dict[str, Any], function: Any = None,
                 instance: Any = None) -> None:
        self.name, self.said = name, False
        given = [(f"passed as argument {index + 1} of `{name}`", value) for index, value in enumerate(args)]
        given += [(f"passed as {key} of `{name}`", value) for key, value in kwargs.items()]
        given += _read_from_outside(name, function, instance)
        self.iterators, known = [], set()
        for label, value in given:
            if isinstance(value, Iterator) and id(value) not in known and _position(value) is not None:
                known.add(id(value))
                self.iterators.append((label, value, _position(value)))

    def failed(self, size: int) -> None:
        """In a failed attempt's handler: one warning (a call) where it drew from an iterator made outside."""
        drawn = [(label, value) for label, value, start in self.iterators if _position(value) != start]
        if drawn and not self.said:
            self.said = True
            label, value = drawn[0]
            warnings.warn(
                f"find_executable_batch_size: the attempt of `{self.name}` at batch {size} ran out of memory after "
                f"drawing from the iterator {label} ({type(value).__name__}): each retry goes on where it stopped, so "
                "what the failed attempts drew is never trained. Pass something read again from its start (a list, "
                f"a Dataset, a DataLoader), or make the iterator inside `{self.name}`",
                RuntimeWarning, stacklevel=6)  # here, KeptLoader.failed, _record_failure, the loop, its wrapper


def _read_from_outside(name: str, function: Any, instance: Any) -> list[tuple[str, Any]]:
    """What ``function`` may read that was made outside it: the globals its code (nested code
    too) names, its closure's variables, and ``instance``'s attributes (a method's ``self``)."""
    found: list[tuple[str, Any]] = []
    try:
        function = inspect.unwrap(function) if function is not None else None
    except ValueError:  # a __wrapped__ cycle
        pass
    code = getattr(function, "__code__", None)
    if code is not None:
        names = {name for current in nested_codes(code) for name in current.co_names}
        scope = getattr(function, "__globals__", {})
        found += [(f"global `{key}` that `{name}` reads", scope[key]) for key in sorted(names) if key in scope]
        found += [(f"`{key}` that `{name}` reads from its enclosing function", value) for key, value in closure_cells(function)]
    attributes = getattr(instance, "__dict__", None)
    if isinstance(attributes, dict):
        found += [(f"`self.{key}` of `{name}`", value) for key, value in list(attributes.items())]
    return found


def _position(value: Any) -> Any:
    """Where an iterator stands, as far as can be seen without drawing from it: a generator's state
    (only its start is seen), a ``DataLoader`` iterator's batches yielded, else its length hint; None
    where none shows."""
    if inspect.isgenerator(value):
        return inspect.getgeneratorstate(value) == inspect.GEN_CREATED or None
    yielded = getattr(value, "_num_yielded", None) if _is_loader_iterator(value) else None
    if isinstance(yielded, int):
        return yielded
    if hasattr(value, "__length_hint__"):
        hint = operator.length_hint(value, -1)
        return hint if hint >= 0 else None
    return None


def _is_loader_iterator(value: Any) -> bool:
    """Whether ``value`` is a ``torch.utils.data.DataLoader``'s iterator (without importing it)."""
    return any(kind.__name__ == "_BaseDataLoaderIter" and kind.__module__.startswith("torch.utils.data")
               for kind in type(value).__mro__)


#: what each message says to do
FIX = ("Build and prepare the loader inside the function: accelerator.prepare(DataLoader(dataset, "
       "batch_size=batch_size)) (unless the function splits each of its batches into chunks of batch_size).")


def _trainer_in(trace: TracebackType | None) -> Any | None:
    """The ``transformers.Trainer`` whose method a failure passed through (a frame's ``self``), or
    None. Read in the ``except`` handler, while the failed frames are still alive. Only the failed
    frames are read: ``f_locals`` of a frame still running (the decorator's own, where the error was
    caught, and its callers) snapshots its locals, the caught exception too, into a dict that frame
    keeps on Python < 3.13, so the traceback pinned every failed frame and its activations through
    the retries (the canonical Accelerate loop, a loader prepared inside, reached batch 1)."""
    running, frame = set(), sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    while trace is not None:
        owner = None if id(trace.tb_frame) in running else trace.tb_frame.f_locals.get("self")
        if any(kind.__name__ == "Trainer" and (kind.__module__ or "").startswith("transformers.")
               for kind in type(owner).__mro__):
            return owner
        trace = trace.tb_next
    return None


def _batch_size(loader: Any) -> int | None:
    """The batch size a loader yields (Accelerate's ``DataLoaderShard`` keeps it on its batch sampler)."""
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(holder, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None
