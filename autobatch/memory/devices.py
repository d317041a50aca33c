"""Memory instruments for the device a probe runs on: capacity, usage, peaks, a cap.

One small interface, two implementations:

* :class:`AcceleratorMemory` reads the caching allocator of CUDA (and ROCm), XPU or MPS
  through ``torch.accelerator`` / ``torch.cuda``. Tensors use *allocated* memory; the
  allocator keeps freed blocks *reserved*; the CUDA context and other processes take memory
  no call frees, so the capacity is what the driver reports free plus what we reserved,
  bounded by the per-process cap.
* :class:`SimulatedDeviceMemory` reads a :class:`~autobatch.memory.simulated.SimulatedMemory`
  budget on the CPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

import torch

from .accounting import tensor_storages
from .allocator import expandable_segments_on
from .simulated import SimulatedMemory, active_simulation, simulated_memory
from .units import decimal_note, format_bytes

__all__ = [
    "DeviceMemory",
    "AcceleratorMemory",
    "SimulatedDeviceMemory",
    "resolve_device",
    "indexed",
    "default_cpu_budget",
    "memory_for",
    "check_limit_in_simulation",
    "simulated_counts",
    "torch_device",
    "device_available",
]


class DeviceMemory(Protocol):
    """What the probe needs to know about a device's memory."""

    name: str

    def capacity(self) -> int: ...
    def allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def peak(self) -> int: ...
    def peak_reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def release_cached(self) -> None: ...
    def synchronize(self) -> None: ...


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means the current accelerator if there is one, else the CPU. A device this
    machine lacks (``"cuda"`` on a CPU-only one, ``"meta"``, a misspelt name) is one
    ``ValueError`` saying which to use (:func:`device_available`), raised
    for every caller (the decorator's ``device=`` too), not torch's error from inside."""
    torch_device("device", device)
    device_available("device", device)
    if device is None:
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            current = accelerator.current_accelerator()
            return torch.device(current.type, accelerator.current_device_index())
        return torch.device("cpu")
    return indexed(torch.device(device))


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare accelerator (``"cuda"``) is the current one
    (``torch.cuda.current_device()``), as torch places a tensor ``.to("cuda")``; the CPU and
    ``meta`` keep theirs. Compare devices by this: a bare ``"cuda"`` matched a model on ``cuda:1``
    while the current device, whose memory was read, was ``cuda:0``."""
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type, torch.accelerator.current_device_index())


def torch_device(name: str, value: Any) -> None:
    """``value`` is None, a ``torch.device`` or a string (or an accelerator's index) torch accepts as one."""
    if value is None or isinstance(value, torch.device):
        return
    try:
        torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # torch's index of the accelerator
            raise ValueError(f"{name}={value!r} is an accelerator's index, and this machine has no accelerator; use "
                             "'cpu' (a simulated memory budget)") from None
        raise ValueError(f"{name}={value!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'cuda:1'") from None


def device_available(name: str, value: Any) -> None:
    """``value`` (None or a valid device) names a device this machine has: the CPU, or an
    accelerator whose backend is available, with that index; not ``meta`` (it holds no memory)."""
    if value is None:
        return
    device = torch.device(value)
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise ValueError(f"{name}={value!r} holds no memory to measure; use 'cpu' (a simulated memory budget) "
                         "or an accelerator")
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if backend is None or available is None or not available():
        raise ValueError(f"{name}={value!r}: this machine has no {device.type} device; use 'cpu' (a simulated "
                         "memory budget) or leave it unset for the current accelerator")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise ValueError(f"{name}={value!r}: this machine has {count()} {device.type} device(s), numbered from 0")


def default_cpu_budget() -> int:
    """The simulated budget used on the CPU when no ``memory_limit`` is given.

    A quarter of the RAM available now, at most 2 GiB: enough to probe small models in
    seconds, never enough to exhaust the machine. Rounded down to 256 MiB, so that the free
    memory's drift between runs does not change the budget (the probe cache keys on it, and
    a budget a few MiB apart missed it every run).
    """
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX
        available = 8 * 1024**3
    step = 256 * 1024**2
    return max(64 * 1024**2, min(2 * 1024**3, available // 4 // step * step))


class AcceleratorMemory:
    """Allocator statistics of one accelerator device (CUDA, ROCm, XPU, MPS)."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # torch's per-process cap calls need an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        label = device.type
        if device.type == "cuda":
            label = f"{device} ({torch.cuda.get_device_name(device)})"
        self.name = label

    def total(self) -> int:
        """Physical memory of the device."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return torch.accelerator.get_memory_info(self.device)[1]

    def cap_fraction(self) -> float:
        """The per-process cap as a fraction of the total (1.0 when uncapped)."""
        if self.device.type == "cuda":
            return torch.cuda.get_per_process_memory_fraction(self.device)
        return 1.0

    def capacity(self) -> int:
        """Bytes this process can hold: what the driver has free plus what we reserved,
        bounded by the per-process cap."""
        free, _ = torch.accelerator.get_memory_info(self.device)
        reachable = free + self.reserved()
        return int(min(reachable, self.total() * self.cap_fraction()))

    def cap_binds(self) -> bool:
        """Whether the per-process cap, not the driver's free memory, bounds :meth:`capacity`.
        The cap counts only the caching allocator's reserved memory; the driver's free memory
        also shrinks by what is allocated outside it (kernels loaded on their first launch,
        library handles, other processes)."""
        free, _ = torch.accelerator.get_memory_info(self.device)
        return self.total() * self.cap_fraction() < free + self.reserved()

    def allocated(self) -> int:
        return _allocated_stat(self.device, "current")

    def reserved(self) -> int:
        return torch.accelerator.memory_reserved(self.device)

    def peak(self) -> int:
        return _allocated_stat(self.device, "peak")

    def peak_reserved(self) -> int:
        return torch.accelerator.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        """Return cached blocks, so a trial's reserved peak is what that trial needed."""
        torch.accelerator.empty_cache()

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.device)

    def inactive_split(self) -> int | None:
        """Bytes now in free pieces of segments that still hold a tensor, which the caching
        allocator cannot return to the driver; None off CUDA, whose allocator does not say.
        (Their peak is no guide: it comes at another moment than the allocated peak.)"""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.current", 0))

    def largest_segment(self) -> int | None:
        """Bytes of the largest segment the caching allocator now holds; None off CUDA and under
        expandable segments (whose segments grow page by page, so their size says nothing of
        one request). Under fixed segments a request above 10 MiB that no cached block serves
        gets a segment of its own, its size rounded up to 2 MiB: after a trial, with the cache
        emptied before it, the largest segment is the trial's largest request (or the largest
        tensor made before the trial)."""
        if self.device.type != "cuda" or expandable_segments_on(self.device):
            return None
        segments = torch.cuda.memory_snapshot()
        return max((int(s["total_size"]) for s in segments if s.get("device") == self.device.index), default=0)

    def alloc_retries(self) -> int | None:
        """How many times the caching allocator has returned its cached blocks to the driver to
        retry an allocation it could not serve (``num_alloc_retries``); None off CUDA. A step
        that does this every time is at the allocator's wall: it trains only while the pieces
        happen to fall right, and it pays a device-wide free and synchronization per step."""
        if self.device.type != "cuda":
            return None
        return _device_stat(self.device, "num_alloc_retries")

    @contextmanager
    def capped(self, limit_bytes: int) -> Iterator[None]:
        """Cap this process at ``limit_bytes`` ("what fits on a 16 GiB card?"), then restore
        the previous cap."""
        if self.device.type != "cuda":
            raise ValueError(
                f"memory_limit is supported on CUDA and the CPU, not on {self.device.type}; "
                "drop memory_limit"
            )
        total = self.total()
        if limit_bytes > total:
            raise ValueError(
                f"memory_limit={format_bytes(limit_bytes)}{decimal_note(limit_bytes)} exceeds the device's "
                f"{format_bytes(total)}; use a smaller memory_limit, or None for the whole device"
            )
        previous = torch.cuda.get_per_process_memory_fraction(self.device)
        torch.cuda.set_per_process_memory_fraction(limit_bytes / total, self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.device)


class SimulatedDeviceMemory:
    """A :class:`SimulatedMemory` budget seen through the :class:`DeviceMemory` interface."""

    def __init__(self, simulation: SimulatedMemory) -> None:
        self.simulation = simulation
        self.name = f"cpu (simulated {format_bytes(simulation.limit_bytes)})"

    def capacity(self) -> int:
        return self.simulation.limit_bytes

    def allocated(self) -> int:
        return self.simulation.current_bytes

    def reserved(self) -> int:
        return self.simulation.current_bytes

    def peak(self) -> int:
        return self.simulation.peak_bytes

    def peak_reserved(self) -> int:
        return self.simulation.peak_bytes

    def reset_peak(self) -> None:
        self.simulation.reset_peak()

    def release_cached(self) -> None:
        pass  # the simulated device caches nothing

    def synchronize(self) -> None:
        pass


def _nested_stats(device: torch.device) -> dict | None:
    """The allocator's nested statistics, or None where torch lacks the nested reader (or the
    allocator has not started): the public readers flatten and sort every statistic on each
    call (80-92 us on an H200 host, against 11 us for the nested read, which waits for no
    kernel), and a trial reads the peak from hooks inside the backward pass
    (:mod:`autobatch.probe.peak_guard`)."""
    nested = getattr(torch._C, "_accelerator_getDeviceStats", None)
    initialized = getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
    if nested is None or initialized is None or device.index is None or not initialized():
        return None
    try:
        return nested(device.index)
    except (TypeError, RuntimeError):
        return None


def _device_stat(device: torch.device, name: str) -> int:
    """One top-level counter of the allocator's statistics (``num_alloc_retries``)."""
    stats = _nested_stats(device)
    if stats is not None and name in stats:
        return int(stats[name])
    return int(torch.accelerator.memory_stats(device).get(name, 0))


def _allocated_stat(device: torch.device, which: str) -> int:
    """The allocator's ``allocated_bytes.all.<which>`` (``current`` or ``peak``), from its nested
    statistics where it can (:func:`_nested_stats`), else from the public readers."""
    stats = _nested_stats(device)
    try:
        if stats is not None:
            return int(stats["allocated_bytes"]["all"][which])
    except (KeyError, TypeError):
        pass
    if which == "peak":
        return torch.accelerator.max_memory_allocated(device)
    return torch.accelerator.memory_allocated(device)


def simulated_counts(tensor: torch.Tensor) -> bool:
    """Whether the innermost active :func:`simulated_memory` budget counts ``tensor``'s storage:
    made inside it as device memory, not before it nor under
    :func:`~autobatch.memory.simulated.host_memory`. False with no active budget."""
    simulation = active_simulation()
    if simulation is None or tensor.device.type != "cpu" or tensor.is_meta:
        return False
    try:
        storages = tensor_storages(tensor)  # a sparse tensor's index and value tensors'
    except (NotImplementedError, RuntimeError):  # a tensor without a plain storage (a subclass, a fake)
        return False
    return bool(storages) and all(storage._cdata in simulation._live for storage in storages)


def check_limit_in_simulation(device: torch.device, memory_limit: int | None) -> None:
    """On the CPU, refuse a ``memory_limit`` given inside an active :func:`simulated_memory` budget of
    another size. Budgets nest (an allocation must fit every one), so a larger limit would be
    bounded by the outer budget while the result, and the cache key, claimed the larger one
    (and a later probe of that limit outside the block was served the smaller answer); a
    smaller one would share the outer budget's bytes already in use. Either way no answer
    describes ``memory_limit``. The same size is taken: it asks what the block does."""
    outer = active_simulation()
    if device.type != "cpu" or memory_limit is None or outer is None or memory_limit == outer.limit_bytes:
        return
    raise ValueError(
        f"memory_limit={format_bytes(memory_limit)}{decimal_note(memory_limit)} was given inside an active autobatch.simulated_memory("
        f"{format_bytes(outer.limit_bytes)}) block, which bounds every allocation, so the probe cannot describe "
        f"{format_bytes(memory_limit)}: drop memory_limit to probe the block's {format_bytes(outer.limit_bytes)}, "
        "or call it outside the simulated_memory block"
    )


@contextmanager
def memory_for(device: torch.device, memory_limit: int | None) -> Iterator[tuple[DeviceMemory, str | None]]:
    """Enter the memory regime a probe on ``device`` runs under; yield its instruments and a
    note for the result (or None).

    CPU: an active :func:`simulated_memory` context is used as it is, with no ``memory_limit`` or
    one of its own size (a second budget of that size inside it would not see the bytes the block
    already holds: the probe planned for room the block no longer had, and its figures left them
    out); else ``memory_limit`` (or, with neither, :func:`default_cpu_budget`) opens a new one. A
    ``memory_limit`` of another size inside an active context is a ``ValueError``
    (:func:`check_limit_in_simulation`).
    Accelerators: ``memory_limit`` caps the process for the duration.
    """
    if device.type == "cpu":
        outer = active_simulation()
        if outer is not None and memory_limit in (None, outer.limit_bytes):
            yield SimulatedDeviceMemory(outer), None
            return
        check_limit_in_simulation(device, memory_limit)
        note = None
        if memory_limit is None:
            memory_limit = default_cpu_budget()
            note = (
                f"CPU probe with no memory_limit: used a simulated budget of "
                f"{format_bytes(memory_limit)} (a quarter of available RAM, at most 2 GiB); "
                "pass memory_limit to ask about a specific device size"
            )
        elif decimal_note(memory_limit):  # "16m": the result's 15.26 MiB is no typo
            note = f"simulated budget of {format_bytes(memory_limit)}{decimal_note(memory_limit)}"
        with simulated_memory(memory_limit) as simulation:
            yield SimulatedDeviceMemory(simulation), note
        return
    instruments = AcceleratorMemory(device)
    if memory_limit is None:
        yield instruments, None
        return
    with instruments.capped(memory_limit):
        yield instruments, f"process capped at {format_bytes(memory_limit)}{decimal_note(memory_limit)} for the probe"
