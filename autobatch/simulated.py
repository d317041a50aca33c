"""A simulated memory-capped device: CPU tensors under a byte budget that OOMs like a GPU.

CI has no GPU, yet every search strategy, fallback and recovery path must be exercised on
real models. :func:`simulated_memory` makes the CPU behave like a small accelerator: while
it is active, every CPU tensor storage that an operator *newly allocates* counts against a
byte budget; an operator whose outputs would push the total past the budget raises
``torch.OutOfMemoryError`` (the exception the CUDA caching allocator raises) and its outputs
are dropped, so the accounting never includes them. Storages are released from the
accounting when they die, so memory comes back exactly as it would on a device.

How: a ``TorchDispatchMode`` sees every ATen operator, forward, backward (the autograd
engine carries the mode to its threads) and optimizer alike. Outputs whose storage is not
among the operator's inputs and not already counted are new allocations; a
``weakref.finalize`` on the storage removes them from the count. Tensors that existed before
the context (say, the model's parameters) are not counted, like memory allocated before a
probe; in-place updates of them allocate nothing. Workspaces internal to one operator are
not seen, so the simulated peak is a slight underestimate of a real allocator's.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .units import format_bytes, parse_bytes

__all__ = ["SimulatedMemory", "simulated_memory", "active_simulation"]

_active: list["SimulatedMemory"] = []


def _storages(values: Any) -> Iterator[torch.UntypedStorage]:
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and not leaf.is_sparse:
            yield leaf.untyped_storage()


class SimulatedMemory(TorchDispatchMode):
    """The accounting behind :func:`simulated_memory`; use that function to create one.

    Attributes ``limit_bytes``, ``current_bytes``, ``peak_bytes`` and ``oom_count`` are live.
    """

    def __init__(self, limit_bytes: int) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self.oom_count = 0
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    # -- the allocator ------------------------------------------------------------------
    def _release(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        inputs = {storage._cdata for storage in _storages((args, kwargs))}
        out = func(*args, **kwargs)
        fresh: dict[int, torch.UntypedStorage] = {}
        grown = 0
        for storage in _storages(out):
            key = storage._cdata
            if key in self._live:
                grown += max(0, storage.nbytes() - self._live[key])  # resized in place
            elif key not in inputs and key not in fresh:
                fresh[key] = storage
        requested = grown + sum(storage.nbytes() for storage in fresh.values())
        if requested == 0:
            return out
        with self._lock:
            if self.current_bytes + requested > self.limit_bytes:
                self.oom_count += 1
                in_use = self.current_bytes
                oom = True
            else:
                oom = False
                for key, storage in fresh.items():
                    self._live[key] = storage.nbytes()
                    weakref.finalize(storage, self._release, key)
                for storage in _storages(out):
                    key = storage._cdata
                    if key in self._live and key not in fresh:
                        self._live[key] = max(self._live[key], storage.nbytes())
                self.current_bytes += requested
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if oom:
            del out, fresh
            raise torch.OutOfMemoryError(
                f"Simulated out of memory: tried to allocate {format_bytes(requested)} in "
                f"{func}; the simulated device has a budget of {format_bytes(self.limit_bytes)}, "
                f"{format_bytes(in_use)} already in use, "
                f"{format_bytes(self.limit_bytes - in_use)} free (autobatch.simulated_memory)."
            )
        return out

    # -- reporting ----------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        """Bytes still available under the budget."""
        return self.limit_bytes - self.current_bytes

    def reset_peak(self) -> None:
        """Start a new peak measurement from the memory in use now."""
        self.peak_bytes = self.current_bytes

    def __repr__(self) -> str:
        return (
            f"SimulatedMemory(limit={format_bytes(self.limit_bytes)}, "
            f"current={format_bytes(self.current_bytes)}, peak={format_bytes(self.peak_bytes)})"
        )


@contextmanager
def simulated_memory(limit: int | str) -> Iterator[SimulatedMemory]:
    """Cap CPU tensor memory at ``limit`` bytes (an int, or a string like ``"512MiB"``).

    While active, an allocation past the budget raises ``torch.OutOfMemoryError``. The yielded
    :class:`SimulatedMemory` reports ``current_bytes`` and ``peak_bytes``; tensors that die give
    their bytes back. Contexts nest: an allocation must fit every active budget.

    >>> with simulated_memory("64MiB") as device:
    ...     x = torch.zeros(1024, 1024)          # 4 MiB, fits
    ...     device.current_bytes
    4194304
    """
    simulation = SimulatedMemory(parse_bytes(limit, name="limit"))
    with simulation:
        _active.append(simulation)
        try:
            yield simulation
        finally:
            _active.remove(simulation)


def active_simulation() -> SimulatedMemory | None:
    """The innermost active :func:`simulated_memory` context, or None."""
    return _active[-1] if _active else None
