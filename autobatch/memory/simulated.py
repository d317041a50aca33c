"""A simulated memory-capped device: CPU tensors under a byte budget that OOMs like a GPU.

CI has no GPU, yet every search strategy, fallback and recovery path must be exercised on
real models. :func:`simulated_memory` makes the CPU behave like a small accelerator: while
it is active, every CPU tensor storage that an operator *newly allocates* counts against a
byte budget; an operator whose outputs would push the total past the budget raises
``torch.OutOfMemoryError`` (the exception the CUDA caching allocator raises, its message
worded like CUDA's, "... out of memory. Tried to allocate ...", so that string-matched
detection such as Accelerate's ``should_reduce_batch_size`` sees it too) and its outputs
are dropped, so the accounting never includes them. Storages are released from the
accounting when they die, so memory comes back exactly as it would on a device.

How: a :class:`~autobatch.memory.accounting.StorageAccountant` over CPU tensors (see there for what
counts as an allocation), which also counts ``UntypedStorage.resize_`` (no operator, so no dispatch
mode sees it; FSDP2 allocates and frees its unsharded parameters that way): growing counts,
shrinking gives back. Tensors that existed before the context (say, the model's
parameters) are not counted, like memory allocated before a probe; in-place updates of them
allocate nothing. Workspaces internal to one operator are not seen, so the simulated peak is a
slight underestimate of a real allocator's; so are bytes that no operator allocates
(``torch.tensor`` of a Python list), the CUDA allocator's rounding of each block to 512 bytes and
other threads' allocations (docs/probe.md, "The simulated memory-capped device").
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..keywords import keywords
from .accounting import StorageAccountant, tensor_storages
from .uncompiled import uncompiled
from .units import format_bytes, parse_bytes

__all__ = ["SimulatedMemory", "simulated_memory", "active_simulation", "host_memory", "to_simulated_device"]


class _Active(threading.local):
    """This thread's active budgets, innermost last: per thread, as torch's dispatch modes are. A
    block open in another thread counts nothing in this one; shared, its budget was taken for
    this thread's (a probe here refused another ``memory_limit`` "inside" it, or read its figures
    and counted nothing) and :func:`host_memory` here paused its counting."""

    def __init__(self) -> None:
        self.budgets: list["SimulatedMemory"] = []


_active = _Active()


def _on_cpu(tensor: torch.Tensor) -> bool:
    # fake tensors (an estimate traced inside a simulation) hold no memory
    return tensor.device.type == "cpu" and not isinstance(tensor, FakeTensor)


class SimulatedMemory(StorageAccountant):
    """The accounting behind :func:`simulated_memory`; use that function to create one.

    Attributes ``limit_bytes``, ``current_bytes``, ``peak_bytes`` and ``oom_count`` are live.
    """

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(_on_cpu, limit_bytes=limit_bytes)
        self.oom_count = 0

    def counts_storage(self, storage: torch.UntypedStorage) -> bool:
        """A CPU storage's ``resize_`` counts (FSDP2 allocates and frees unsharded parameters so)."""
        return storage.device.type == "cpu"

    def _enclosing(self) -> list[StorageAccountant]:
        """The budgets of the blocks around this one: an allocation this one refuses never raises their peaks."""
        budgets = _active.budgets
        return budgets[:budgets.index(self)] if len(budgets) > 1 and self in budgets else []

    def over_limit(self, func, requested: int, in_use: int) -> None:
        self.oom_count += 1
        raise torch.OutOfMemoryError(
            f"Simulated out of memory. Tried to allocate {format_bytes(requested)} in "
            f"{func}; the simulated device has a budget of {format_bytes(self.limit_bytes)}, "
            f"{format_bytes(in_use)} already in use, "
            f"{format_bytes(self.limit_bytes - in_use)} free (autobatch.simulated_memory)."
        )

    # -- reporting ----------------------------------------------------------------------
    @property
    def free_bytes(self) -> int:
        """Bytes still available under the budget."""
        return self.limit_bytes - self.current_bytes

    def __repr__(self) -> str:
        return (
            f"SimulatedMemory(limit={format_bytes(self.limit_bytes)}, "
            f"current={format_bytes(self.current_bytes)}, peak={format_bytes(self.peak_bytes)})"
        )


@keywords(synonyms={"memory_limit": "limit"})  # the name every other entry point gives the budget
@contextmanager
def simulated_memory(limit: int | str) -> Iterator[SimulatedMemory]:
    """Cap CPU tensor memory at ``limit`` bytes (an int, or a string like ``"512MiB"``);
    ``memory_limit=`` is taken for ``limit``, as ``find_max_batch`` and the runner name the budget.

    While active, an allocation past the budget raises ``torch.OutOfMemoryError``. The yielded
    :class:`SimulatedMemory` reports ``current_bytes`` and ``peak_bytes``; tensors that die give
    their bytes back. Contexts nest: an allocation must fit every active budget. A context is
    active in the thread that entered it (and in the autograd threads of its backward passes),
    as torch's dispatch modes are: threads probing at once each have their own.

    >>> with simulated_memory("64MiB") as device:
    ...     x = torch.zeros(1024, 1024)          # 4 MiB, fits
    ...     device.current_bytes
    4194304
    """
    simulation = SimulatedMemory(parse_bytes(limit, name="limit"))
    with simulation, uncompiled():  # compiled code runs eagerly here, and compiles again after (uncompiled.py)
        _active.budgets.append(simulation)
        try:
            yield simulation
        finally:
            _active.budgets.remove(simulation)


def active_simulation() -> SimulatedMemory | None:
    """The innermost :func:`simulated_memory` context active in this thread, or None."""
    return _active.budgets[-1] if _active.budgets else None


@contextmanager
def host_memory() -> Iterator[None]:
    """Allocate host memory while a :func:`simulated_memory` context is active.

    The simulated device stands for an accelerator whose memory is separate from the host's;
    CPU tensors created inside this context are the *host's* (a pinned staging buffer on a
    GPU, the runner's ``step_guard="cpu"`` snapshot), so no active budget counts them, ever.
    Without it, a snapshot that costs a GPU nothing would take device memory in the
    simulation, and the simulated runner would fail at a batch that a GPU trains.
    """
    paused = list(_active.budgets)
    for simulation in paused:
        simulation.paused += 1
    try:
        yield
    finally:
        for simulation in paused:
            simulation.paused -= 1


def to_simulated_device(tensor: torch.Tensor) -> torch.Tensor:
    """What moving ``tensor`` to the simulated device does: a tensor whose storage no active
    budget counts (host memory: made before the simulation, or under :func:`host_memory`) is
    copied, so the copy takes device memory as a host-to-device transfer does on a GPU; a tensor
    already counted is returned as it is. Without an active simulation, ``tensor`` itself."""
    simulation = active_simulation()
    if simulation is None or not _on_cpu(tensor):
        return tensor
    storages = tensor_storages(tensor)  # a sparse tensor's parts; none for an opaque one
    if storages and all(storage._cdata in simulation._live for storage in storages):
        return tensor
    return tensor.clone()
