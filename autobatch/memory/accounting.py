"""Storage accounting: count the bytes of tensor storages that operators newly allocate.

The one place that decides what "an allocation" is, shared by :mod:`autobatch.memory.simulated` (real
CPU tensors under a byte budget) and :mod:`autobatch.probe.tracing.estimate` (fake tensors, no memory at
all). A ``TorchDispatchMode`` sees every ATen operator, forward, backward (the autograd engine
carries the mode to its threads) and optimizer alike. Outputs whose storage is not among the
operator's inputs and not already counted are new allocations; a ``weakref.finalize`` on the
storage removes them from the count when it dies, so memory comes back as it would on a
device. Storages that existed before the mode was entered are not counted; in-place updates
and views allocate nothing, but an operator that grows such a storage in place (``resize_``, an
``out=`` tensor too small for its result) counts the growth, as its ``resize_`` below does. Workspaces internal to one operator are not seen. A sparse tensor
counts by its index and value tensors; an opaque (MKL-DNN) one, which shows no storage, not at all.

``UntypedStorage.resize_`` is no operator (on the CPU it resizes the bytes directly), so no
dispatch mode sees it; FSDP2 (``fully_shard``) allocates and frees its unsharded parameters
exactly that way (``alloc_storage``/``free_storage``). An accountant that counts such resizes
(:meth:`StorageAccountant.counts_storage`) has ``resize_`` wrapped while it is entered
(:func:`_resizes_seen`): growth counts (and can run out of memory before the bytes change),
shrinking gives back, to 0 and again. The ordinary path (operators) is untouched.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["StorageAccountant", "OperationLimit", "tensor_storages"]


_COMPONENTS = {  # a sparse tensor has no storage of its own: its index and value tensors hold its data
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def tensor_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s data: its own; a sparse tensor's index and value
    tensors' (``untyped_storage()`` raises for CSR/CSC/BSR/BSC, so an op on one crashed under the
    simulation); none for an opaque tensor (MKL-DNN), whose memory no storage shows."""
    names = _COMPONENTS.get(tensor.layout)
    if names is not None:
        return [storage for name in names for storage in tensor_storages(getattr(tensor, name)())]
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # "Cannot access storage of OpaqueTensorImpl"
        return []


def _tensors(values: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs, into ``found``. What reaches a dispatch
    mode is tensors, lists and tuples of them (``Tensor[]``, ``Tensor?[]``, several outputs),
    scalars and the keyword arguments' dict: walked here directly, where the general pytree walk
    ran two or three times per operator (a simulated MLP step on the CPU: 21-26 ms with it, 10-14 ms
    without)."""
    if isinstance(values, torch.Tensor):
        found.append(values)
    elif isinstance(values, (list, tuple)):
        for value in values:
            _tensors(value, found)
    elif isinstance(values, dict):
        for value in values.values():
            _tensors(value, found)
    return found


def _storages(values: Any, counts: Callable[[torch.Tensor], bool]) -> list[torch.UntypedStorage]:
    return [storage for leaf in _tensors(values, []) if counts(leaf) for storage in tensor_storages(leaf)]


_resize_lock = threading.Lock()
_resize_users = 0
_plain_resize = torch.UntypedStorage.resize_


def _seen_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` as every accountant active in this thread sees it: each checks
    the growth against its budget first (an OOM leaves the storage as it was, as a failed device
    allocation does), then the bytes change, then each counts the change."""
    accountants = [mode for mode in _get_current_dispatch_mode_stack()
                   if isinstance(mode, StorageAccountant) and mode.counts_storage(storage)]
    if not accountants:
        return _plain_resize(storage, size)
    before = storage.nbytes()
    for accountant in accountants:
        accountant._check_resize(storage, before, size)
    out = _plain_resize(storage, size)
    for accountant in accountants:
        accountant._count_resize(storage, before, storage.nbytes())
    return out


class _resizes_seen:
    """While any accountant that counts resizes is entered (in any thread), ``resize_`` is
    :func:`_seen_resize`; the plain method again once the last one leaves."""

    @staticmethod
    def enter() -> None:
        global _resize_users
        with _resize_lock:
            _resize_users += 1
            torch.UntypedStorage.resize_ = _seen_resize

    @staticmethod
    def leave() -> None:
        global _resize_users
        with _resize_lock:
            _resize_users -= 1
            if _resize_users == 0:
                torch.UntypedStorage.resize_ = _plain_resize


class OperationLimit(RuntimeError):
    """More operators ran under a :class:`StorageAccountant` than its ``op_limit``: the trace that
    set the limit stops there (a fake-tensor trace whose cost grows with the batch)."""


class StorageAccountant(TorchDispatchMode):
    """Counts live bytes of storages allocated by operators while the mode is active.

    ``counts(tensor)`` selects the tensors that live on the device being accounted (say, CPU
    tensors, or fake tensors on ``cuda``). ``round_to`` rounds every storage up to a multiple
    (the CUDA caching allocator hands out blocks in multiples of 512 bytes). ``limit_bytes``,
    when set, makes an operator whose outputs would pass it call :meth:`over_limit` (which
    raises); its outputs are dropped first, so the count never includes them.

    Attributes ``current_bytes`` and ``peak_bytes`` are live; ``operations`` counts the operators
    it saw, and past ``op_limit`` (when set) the next one raises :class:`OperationLimit`.
    """

    def __init__(
        self,
        counts: Callable[[torch.Tensor], bool],
        *,
        limit_bytes: int | None = None,
        round_to: int = 1,
    ) -> None:
        super().__init__()
        self.counts = counts
        self.limit_bytes = limit_bytes
        self.round_to = max(1, round_to)
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}
        # re-entrant: a garbage collection can run at any allocation inside the locked section
        # (``weakref.finalize`` allocates) and free a counted storage, whose release takes the lock
        # again on this thread; a plain lock waited for itself there, and the process hung
        self._lock = threading.RLock()
        #: while > 0, new storages are not counted (see :func:`~autobatch.memory.simulated.host_memory`)
        self.paused = 0
        self.operations = 0
        self.op_limit: int | None = None

    def _size(self, storage: torch.UntypedStorage) -> int:
        return self._sized(storage.nbytes())

    def _sized(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def _track(self, key: int, storage: torch.UntypedStorage) -> int:
        """Count a new storage (under the lock) until it dies; returns its counted bytes."""
        self._live[key] = size = self._size(storage)
        weakref.finalize(storage, self._release, key)
        return size

    def _release(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(key, 0)

    def counts_storage(self, storage: torch.UntypedStorage) -> bool:
        """Whether a ``storage.resize_`` outside any operator counts here (see the module's
        docstring). None does by default: a fake trace resizes fake (meta) storages itself."""
        return False

    def __enter__(self):  # noqa: D105
        if type(self).counts_storage is not StorageAccountant.counts_storage:
            _resizes_seen.enter()
        try:
            return super().__enter__()
        except BaseException:
            self._leave_resizes()
            raise

    def __exit__(self, *exc: Any) -> Any:  # noqa: D105
        try:
            return super().__exit__(*exc)
        finally:
            self._leave_resizes()

    def _leave_resizes(self) -> None:
        if type(self).counts_storage is not StorageAccountant.counts_storage:
            _resizes_seen.leave()

    def _check_resize(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """Call :meth:`over_limit` when resizing ``storage`` from ``before`` to ``after`` bytes
        would pass the budget."""
        key = storage._cdata
        if self.limit_bytes is None or (self.paused and key not in self._live):
            return
        grown = self._sized(after) - self._sized(before)
        with self._lock:
            in_use = self.current_bytes
        if grown > 0 and in_use + grown > self.limit_bytes:
            self.over_limit("UntypedStorage.resize_", grown, in_use)

    def _count_resize(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """Count a resize from ``before`` to ``after`` bytes. A storage counted already changes
        by the difference (never below 0); one not counted (made before the mode, its bytes the
        host's or the model's) counts what it grows by, from then on until it dies."""
        key = storage._cdata
        change = self._sized(after) - self._sized(before)
        with self._lock:
            if key in self._live:
                counted = max(0, self._live[key] + change)
                self.current_bytes += counted - self._live[key]
                self._live[key] = counted
            elif change > 0 and not self.paused:
                self._live[key] = change
                weakref.finalize(storage, self._release, key)
                self.current_bytes += change
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _enclosing(self) -> list["StorageAccountant"]:
        """The accountants entered before this one, in this thread, that count what it counts: they
        see an operator's outputs before it does (inside its call of the operator), so where this one
        raises its out-of-memory error their peaks are put back. None by default."""
        return []

    def over_limit(self, func: Any, requested: int, in_use: int) -> None:
        """Called (outside the lock) when ``requested`` bytes would pass ``limit_bytes``;
        must raise. Subclasses word the error."""
        raise torch.OutOfMemoryError(f"{requested} bytes requested by {func} with {in_use} in use")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        self.operations += 1
        if self.op_limit is not None and self.operations > self.op_limit:
            raise OperationLimit(f"more than {self.op_limit} operators ran")
        enclosing = [(accountant, accountant.peak_bytes) for accountant in self._enclosing()]
        # each input storage's bytes before the operator: one it grows in place counts its growth
        inputs = {storage._cdata: storage.nbytes() for storage in _storages((args, kwargs), self.counts)}
        out = func(*args, **kwargs)
        fresh: dict[int, torch.UntypedStorage] = {}
        grown = 0
        outputs = _storages(out, self.counts)
        uncounted: dict[int, tuple[torch.UntypedStorage, int]] = {}  # not counted before, grown here
        for storage in outputs:
            key = storage._cdata
            if key in self._live:
                grown += max(0, self._size(storage) - self._live[key])  # resized in place
            elif key in inputs:  # made before the mode (or as host memory): its growth counts, as a resize's
                change = self._sized(storage.nbytes()) - self._sized(inputs[key])
                if change > 0:
                    uncounted[key] = (storage, change)
            elif key not in fresh:
                fresh[key] = storage
        requested = grown + sum(self._size(storage) for storage in fresh.values())
        requested += sum(change for _, change in uncounted.values())
        if requested == 0 and not fresh:
            return out  # an empty new storage (``torch.empty(0)``) is still tracked: what it grows to counts
        with self._lock:
            oom = self.limit_bytes is not None and self.current_bytes + requested > self.limit_bytes
            in_use = self.current_bytes
            if not oom:
                for storage in outputs:
                    key = storage._cdata
                    if key in self._live:
                        self._live[key] = max(self._live[key], self._size(storage))
                for key, storage in fresh.items():
                    self._track(key, storage)
                for key, (storage, change) in uncounted.items():
                    self._live[key] = change
                    weakref.finalize(storage, self._release, key)
                self.current_bytes += requested
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if oom:
            del out, fresh, outputs, uncounted
            for accountant, peak in enclosing:  # they counted what this budget refused: it never existed
                accountant.peak_bytes = peak
            self.over_limit(func, requested, in_use)
        return out

    def adopt(self, storages: list[torch.UntypedStorage], transient_bytes: int = 0) -> None:
        """Count ``storages``, allocated while the mode was not active, as if an operator had just
        returned them (each released when it dies), after a transient of ``transient_bytes`` above
        the memory in use: what building them took at its peak. Used for a batch the estimate had
        to build for real (:class:`~autobatch.probe.tracing.trace_failures.RealBatches`)."""
        with self._lock:
            self.peak_bytes = max(self.peak_bytes, self.current_bytes + transient_bytes)
            for storage in storages:
                key = storage._cdata
                if key not in self._live:
                    self.current_bytes += self._track(key, storage)
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def reset_peak(self) -> None:
        """Start a new peak measurement from the memory in use now."""
        self.peak_bytes = self.current_bytes
