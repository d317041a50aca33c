"""A retry of :func:`~autobatch.integrations.decorator.find_executable_batch_size` that resumes
from a checkpoint a failed attempt of the same call saved, and skips its done batches at another
batch size (:class:`ResumeWatch`).

Why: a function that resumes from its own checkpoint at its top (``accelerator.load_state(dir)``,
then ``accelerator.skip_first_batches(loader, steps_done)``) and saves one while it trains
(``accelerator.save_state(dir)``) resumes the retry from the failed attempt's last checkpoint,
which is right, but ``skip_first_batches`` counts batches of the *retry's* size, while the
checkpoint counted the failed attempt's: 2 steps at batch 16 (32 samples) resumed at batch 12
skip 24 samples, and samples 24-31 were trained twice (a larger retry skipped some), silently.
It cannot be made exact by skipping other batches (32 samples are not a whole number of batches
of 12, and the user's step counter would disagree), so the retry is one warning naming the fix;
where the attempt that ran skipped with other figures (a later retry at another size), one more
when the call returns gives those (:meth:`ResumeWatch.returned`).

How: for the duration of a decorated call, and only where Accelerate is imported, the
``Accelerator`` class's ``save_state``, ``load_state`` and ``skip_first_batches`` are wrapped
(put back when the last active call ends, whatever happened): a save notes where it wrote and the
batch size it trained at (the loader being iterated, else the attempt's size), a load in a later
attempt of the call picks that size up, and a ``skip_first_batches(loader, n)`` with ``n > 0`` after
it, over a loader of another batch size, is the warning. Nothing is copied or read from disk.
The module-level ``accelerate.skip_first_batches`` (``accelerate.data_loader``'s, which the method
calls) is usually imported by name before any call (``from accelerate import skip_first_batches``),
so no module attribute swapped during a call reaches it: what it builds is watched instead, the
``SkipBatchSampler`` (a map-style dataset) or the loader given ``skip_batches`` (an iterable one),
and the warning points at the first frame outside Accelerate (the user's skip line).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any

__all__ = ["ResumeWatch", "resume_message"]

_METHODS = ("save_state", "load_state", "skip_first_batches")
#: the calls whose attempts are watched, innermost last; the class's own methods while any is
_ACTIVE: list["ResumeWatch"] = []
_ORIGINAL: dict[str, Any] = {}
_PATCHED: list[type] = []
#: what ``skip_first_batches`` builds, with its own ``__init__``, while a call is active
_BUILT: list[tuple[type, Any]] = []
_BUILDS = ("SkipBatchSampler", "SkipDataLoader", "DataLoaderShard", "DataLoaderDispatcher")


class ResumeWatch:
    """The checkpoints one decorated call's attempts saved (where, at which batch size, and in which
    attempt), the one the running attempt loaded, and whether the call has warned."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.attempt, self.size = 0, None  # the running attempt's number and batch size
        self.saved: dict[str | None, tuple[int, int]] = {}  # where -> (batch size, attempt)
        self.last: tuple[int, int] | None = None  # the latest save of the call
        self.loaded: tuple[int, int] | None = None  # the save the running attempt loaded
        #: the running attempt's mismatched skip (saved size, its size, count), and the one warned of (None: no warning yet)
        self.skipped: tuple[int, int, int] | None = None
        self.warned_of: tuple[int, int, int] | None = None

    def __enter__(self) -> "ResumeWatch":
        accelerator = getattr(sys.modules.get("accelerate"), "Accelerator", None)
        if isinstance(accelerator, type):
            if not _ACTIVE:
                _patch(accelerator)
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _unpatch()

    def started(self, size: int) -> None:
        """At an attempt's start: its batch size; nothing loaded yet."""
        self.attempt, self.size, self.loaded, self.skipped = self.attempt + 1, size, None, None

    def returned(self, stacklevel: int) -> None:
        """The call returned: where the attempt that ran skipped with other figures than the retry
        warned of (a later retry, at another size, loaded the same checkpoint), one more warning with
        the figures of the run that counts. Why: the one warning named the first retry's figures
        (samples 484-511 twice, at batch 121), and the attempt that ran at 87 trained 348-511 twice."""
        if self.skipped is not None and self.skipped != self.warned_of:
            saved, now, count = self.warned_of = self.skipped
            warnings.warn(resume_message(self.name, saved, now, count, ran=True), RuntimeWarning, stacklevel=stacklevel)

    def _saved(self, where: Any, size: int | None) -> None:
        if (size := size or self.size) is not None:
            self.last = self.saved[_key(where)] = (size, self.attempt)

    def _loaded(self, where: Any) -> None:
        self.loaded = self.last if where is None else self.saved.get(_key(where))

    def _skipping(self, loader: Any, count: Any, stacklevel: int = 3, size: int | None = None) -> None:
        """A ``skip_first_batches(loader, count)``: the warning where the running attempt loaded a
        checkpoint an earlier attempt of this call saved at another batch size than ``loader``'s
        (``size``, where what skips is not the loader: a ``SkipBatchSampler``'s)."""
        if self.loaded is None or not isinstance(count, int) or count <= 0:
            return
        saved, attempt = self.loaded
        now = size or _batch_size(loader) or self.size
        if attempt < self.attempt and now is not None and now != saved:
            self.skipped = (saved, now, count)
            if self.warned_of is not None:  # one warning at the skip; returned() tells the attempt that ran
                return
            self.warned_of = self.skipped
            # here, the wrapper, the caller's skip_first_batches line (a built object's: counted)
            warnings.warn(resume_message(self.name, saved, now, count), RuntimeWarning, stacklevel=stacklevel)


def resume_message(name: str, saved: int, now: int, count: int, ran: bool = False) -> str:
    """The warning of a retry that skips ``count`` batches of ``now`` from a checkpoint saved at
    ``saved``; ``ran``: said when the call returned, of the attempt that ran."""
    done, skipped = count * saved, count * now
    effect = (f"samples {skipped}-{done - 1} are trained twice" if skipped < done
              else f"samples {done}-{skipped - 1} are never trained")
    which = "the retry that ran, at batch" if ran else "a retry at batch"
    return (f"find_executable_batch_size: {name} resumed {which} {now} from a checkpoint a failed "
            f"attempt saved at batch {saved}, and skip_first_batches(loader, {count}) skips {count} batches "
            f"of {now} ({skipped} samples); if {count} counts the checkpoint's batches ({done} samples), "
            f"{effect}. Save the samples done with the checkpoint (steps x batch size) and skip those: "
            "build the loader over torch.utils.data.Subset(dataset, range(samples_done, len(dataset))) "
            "(the same order at each attempt: a seeded or no shuffle) instead of skip_first_batches.")


def _key(where: Any) -> str | None:
    try:
        return os.path.realpath(os.fspath(where)) if where is not None else None
    except TypeError:
        return None


def _batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _active_size(accelerator: Any) -> int | None:
    """The batch size of the prepared loader being iterated (the steps' size), or None."""
    state = getattr(accelerator, "gradient_state", None)
    return _batch_size(getattr(state, "active_dataloader", None))


def _patch(accelerator: type) -> None:
    """Wrap ``accelerator``'s methods (:data:`_METHODS`) so the active calls see them."""
    for method in _METHODS:
        own = vars(accelerator).get(method)
        if own is None:
            continue
        _ORIGINAL[method] = own
        setattr(accelerator, method, _wrapper(method, own))
    _PATCHED.append(accelerator)
    module = sys.modules.get("accelerate.data_loader")
    for name in _BUILDS:
        kind = getattr(module, name, None)
        if isinstance(kind, type) and "__init__" in vars(kind):
            _BUILT.append((kind, vars(kind)["__init__"]))
            kind.__init__ = _built(vars(kind)["__init__"])  # type: ignore[misc]


def _built(own: Any) -> Any:
    """``own`` (an ``__init__`` of what ``skip_first_batches`` builds) that reports a skip of
    ``skip_batches > 0`` to the innermost active call, with the batch size skipped over: the
    batch sampler's (``SkipBatchSampler(batch_sampler, skip_batches)``) or the loader's ``batch_size``."""
    @functools.wraps(own)
    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        count = kwargs.get("skip_batches", args[1] if type(self).__name__ == "SkipBatchSampler" and len(args) > 1 else 0)
        if _ACTIVE and isinstance(count, int) and count > 0:
            sampler = args[0] if type(self).__name__ == "SkipBatchSampler" and args else kwargs.get("batch_sampler")
            size = _batch_size(sampler) or kwargs.get("batch_size")
            _ACTIVE[-1]._skipping(None, count, stacklevel=_outside_accelerate(), size=size)
        return own(self, *args, **kwargs)
    return watched


def _wrapper(method: str, own: Any) -> Any:
    @functools.wraps(own)
    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = args[0] if args else kwargs.get("output_dir" if method == "save_state" else "input_dir")
        if method == "skip_first_batches" and _ACTIVE:
            _ACTIVE[-1]._skipping(args[0] if args else kwargs.get("dataloader"),
                                  args[1] if len(args) > 1 else kwargs.get("num_batches", 0))
        size = _active_size(self) if method == "save_state" else None
        result = own(self, *args, **kwargs)
        for watch in list(_ACTIVE):  # after the call: a save or load that raised did nothing
            if method == "save_state":
                watch._saved(result if isinstance(result, (str, os.PathLike)) else where, size)
            elif method == "load_state":
                watch._loaded(where)
        return result
    return watched


def _outside_accelerate() -> int:
    """The ``stacklevel`` for :meth:`ResumeWatch._skipping`, called from :func:`_built`'s wrapper
    (this function's caller): the first frame outside Accelerate, where the user called
    ``skip_first_batches`` (its method, or the function)."""
    package = os.path.dirname(getattr(sys.modules.get("accelerate"), "__file__", None) or "?") + os.sep
    frame, level = sys._getframe(2), 3  # the wrapper's caller, as _skipping's warn counts it
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _unpatch() -> None:
    """The class's own methods back."""
    for accelerator in _PATCHED:
        for method, own in _ORIGINAL.items():
            setattr(accelerator, method, own)
    _PATCHED.clear()
    _ORIGINAL.clear()
    for kind, own in _BUILT:
        kind.__init__ = own  # type: ignore[misc]
    _BUILT.clear()
