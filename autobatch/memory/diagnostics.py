"""Memory diagnostics: the figures a person checks when a batch is close to the edge.

A batch size alone does not say why it is the limit. The allocator does: *allocated* memory
is what tensors hold; *reserved* memory is what the caching allocator took from the device;
the difference, the fragmentation gap, is memory no tensor uses but no other allocation
could get either. Allocator retries (a failed ``cudaMalloc`` answered by freeing the cache
and trying again) show a step running at the edge before it runs out. On CUDA the
allocator's own ``memory_summary()`` table is kept as text; the simulated CPU device writes a
short one of its own.

:func:`memory_diagnostics` reads them from a :class:`~autobatch.memory.devices.DeviceMemory`; the
probe stores the result in ``ProbeResult.diagnostics`` and in
:class:`~autobatch.NoBatchFitsError`'s ``diagnostics``.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from .devices import AcceleratorMemory, DeviceMemory, SimulatedDeviceMemory
from .oom import recognised_ooms
from .units import format_bytes

__all__ = ["memory_diagnostics", "diagnostics_line", "oom_count", "oom_mark", "caught_between", "caught_since"]

log = logging.getLogger("autobatch")

class FailedTrial(Protocol):
    """What the diagnostics read of a failed trial (a probe's ``TrialRecord`` has these)."""

    batch_size: int
    peak_bytes: int | None
    reserved_bytes: int | None
    error: str | None


#: Counters of ``memory_stats()`` kept in the diagnostics when the device reports them.
STAT_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def memory_diagnostics(memory: DeviceMemory, *, failed_trial: FailedTrial | None = None) -> dict[str, Any]:
    """A JSON-able snapshot of ``memory`` now.

    Keys: ``device``, ``capacity_bytes``, ``allocated_bytes``, ``reserved_bytes``,
    ``peak_allocated_bytes`` and ``peak_reserved_bytes`` (peaks since the last reset, i.e. of
    the last trial), ``fragmentation_gap_bytes`` (reserved - allocated now),
    ``peak_fragmentation_gap_bytes`` (reserved peak - allocated peak), the allocator counters
    of :data:`STAT_COUNTERS` the device reports (cumulative for the process; None where it
    reports none), and ``memory_summary`` (text). With ``failed_trial``, ``failed_trial`` holds
    that trial's batch size, peaks and gap at the failure.

    Never raises: a figure the device cannot give is None, and why goes to the debug log.
    """
    data: dict[str, Any] = {"device": memory.name}
    for key, read in (
        ("capacity_bytes", memory.capacity),
        ("allocated_bytes", memory.allocated),
        ("reserved_bytes", memory.reserved),
        ("peak_allocated_bytes", memory.peak),
        ("peak_reserved_bytes", memory.peak_reserved),
    ):
        data[key] = _safely(read)
    data["fragmentation_gap_bytes"] = _gap(data["reserved_bytes"], data["allocated_bytes"])
    data["peak_fragmentation_gap_bytes"] = _gap(data["peak_reserved_bytes"], data["peak_allocated_bytes"])
    stats = _allocator_stats(memory)
    for counter in STAT_COUNTERS:
        data[counter] = stats.get(counter)
    if isinstance(memory, SimulatedDeviceMemory):
        data["num_ooms"] = memory.simulation.oom_count
    data["memory_summary"] = _summary_text(memory, data)
    if failed_trial is not None:
        data["failed_trial"] = {
            "batch_size": failed_trial.batch_size,
            "peak_allocated_bytes": failed_trial.peak_bytes,
            "peak_reserved_bytes": failed_trial.reserved_bytes,
            "fragmentation_gap_bytes": _gap(failed_trial.reserved_bytes, failed_trial.peak_bytes),
            "error": failed_trial.error,
        }
    return data


def diagnostics_line(diagnostics: dict[str, Any] | None) -> str:
    """One compact line for an error message: allocated, reserved, the gap, retries.

    Uses the failed trial's figures when there are some (they describe the failure; the
    current ones describe memory after the cleanup)."""
    if not diagnostics:
        return ""
    failed = diagnostics.get("failed_trial")
    if failed:
        text = (
            f"at the failure (batch {failed['batch_size']}): allocated peak "
            f"{format_bytes(failed['peak_allocated_bytes'])}, reserved peak "
            f"{format_bytes(failed['peak_reserved_bytes'])}, gap {format_bytes(failed['fragmentation_gap_bytes'])}"
        )
    else:
        text = (
            f"allocated {format_bytes(diagnostics.get('allocated_bytes'))}, reserved "
            f"{format_bytes(diagnostics.get('reserved_bytes'))}, gap "
            f"{format_bytes(diagnostics.get('fragmentation_gap_bytes'))}"
        )
    counts = [
        f"{label} {diagnostics[key]}"
        for key, label in (("num_alloc_retries", "allocator retries"), ("num_ooms", "OOMs"))
        if diagnostics.get(key) is not None
    ]
    return "Memory " + text + (f"; {', '.join(counts)}" if counts else "") + "."


def _safely(read) -> int | None:
    try:
        return int(read())
    except Exception as exc:  # noqa: BLE001 - a diagnostic must never break the probe
        log.debug("memory diagnostics: %s failed (%s: %s)", getattr(read, "__name__", read), type(exc).__name__, exc)
        return None


def _gap(reserved: int | None, allocated: int | None) -> int | None:
    return None if reserved is None or allocated is None else reserved - allocated


def oom_count(memory: DeviceMemory | None) -> int | None:
    """Out-of-memory errors ``memory``'s device has raised so far in the process: an
    accelerator's ``num_ooms`` (0 before its allocator has stats), a simulated budget's
    ``oom_count``; None where the device counts none (the CPU outside a simulated budget)."""
    if isinstance(memory, SimulatedDeviceMemory):
        return int(memory.simulation.oom_count)
    if not isinstance(memory, AcceleratorMemory):
        return None
    return int(_allocator_stats(memory).get("num_ooms", 0))


def oom_mark(memory: DeviceMemory | None) -> tuple[int, int] | None:
    """Where the out-of-memory counts stand now: the device's (:func:`oom_count`) and the handlers'
    (:func:`~autobatch.memory.oom.recognised_ooms`); None where the device counts none."""
    ooms = oom_count(memory)
    return None if ooms is None else (ooms, recognised_ooms())


def caught_between(mark: tuple[int, int], now: tuple[int, int]) -> int:
    """Out-of-memory errors the device raised between two :func:`oom_mark` readings that no handler
    recognised: code between caught them itself (a user's ``except``, a library's retry)."""
    return max(0, (now[0] - mark[0]) - (now[1] - mark[1]))


def caught_since(memory: DeviceMemory | None, mark: tuple[int, int] | None) -> int | None:
    """:func:`caught_between` ``mark`` and now; None where nothing is counted. The decorator's
    warning and the probe's trials (:mod:`autobatch.probe.caught`) read it."""
    now = oom_mark(memory) if mark is not None else None
    return None if now is None else caught_between(mark, now)


def _allocator_stats(memory: DeviceMemory) -> dict[str, Any]:
    """``memory_stats()`` of an accelerator (empty elsewhere, or when it reports nothing)."""
    if not isinstance(memory, AcceleratorMemory):
        return {}
    try:
        import torch

        if memory.device.type == "cuda":
            return dict(torch.cuda.memory_stats(memory.device))
        return dict(torch.accelerator.memory_stats(memory.device))
    except Exception as exc:  # noqa: BLE001
        log.debug("memory diagnostics: memory_stats failed (%s: %s)", type(exc).__name__, exc)
        return {}


def _summary_text(memory: DeviceMemory, data: dict[str, Any]) -> str:
    """The allocator's own summary on CUDA; a short table of our figures elsewhere."""
    if isinstance(memory, AcceleratorMemory) and memory.device.type == "cuda":
        try:
            import torch

            return torch.cuda.memory_summary(memory.device, abbreviated=True)
        except Exception as exc:  # noqa: BLE001
            log.debug("memory diagnostics: memory_summary failed (%s: %s)", type(exc).__name__, exc)
    rows = [("device", memory.name)]
    if isinstance(memory, SimulatedDeviceMemory):
        rows.append(("budget", format_bytes(memory.simulation.limit_bytes)))
    rows += [
        ("capacity", format_bytes(data["capacity_bytes"])),
        ("allocated", format_bytes(data["allocated_bytes"])),
        ("reserved", format_bytes(data["reserved_bytes"])),
        ("peak allocated", format_bytes(data["peak_allocated_bytes"])),
        ("peak reserved", format_bytes(data["peak_reserved_bytes"])),
        ("fragmentation gap", format_bytes(data["fragmentation_gap_bytes"])),
    ]
    rows += [(key.replace("_", " "), str(data[key])) for key in STAT_COUNTERS if data.get(key) is not None]
    return "\n".join(f"{label:<18} {value}" for label, value in rows)
