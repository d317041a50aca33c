"""The host memory behind the CPU's simulated device.

A :func:`~autobatch.memory.simulated.simulated_memory` budget counts real tensors in host memory:
a probe's trials climb until they reach it, so a ``memory_limit`` on the CPU past the memory the
machine has available was never reached. The host's allocator failed first (counted as an
out-of-memory trial at a size the budget did not set, and answered as if it had) or the kernel
killed the process (``memory_limit="64GiB"`` on a 24 GiB machine: its first trial, placed below
the estimated boundary, asked for 8 GiB at once). :func:`check_host_room` refuses such a limit
before any trial.
"""

from __future__ import annotations

import os

import torch

from .units import format_bytes

__all__ = ["available_host_bytes", "check_host_room"]


def available_host_bytes() -> int | None:
    """The host memory available now (``MemAvailable`` of ``/proc/meminfo``, which counts the page
    cache the kernel can drop; elsewhere the free pages), or None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def check_host_room(device: torch.device, memory_limit: int | None, max_batch: int | None) -> None:
    """A ``memory_limit`` for trials on the CPU above the host memory available now is one
    ``ValueError`` (see the module's docstring); not with ``max_batch``, which may keep the trials
    far below it, nor for the estimate, which allocates nothing."""
    if device.type != "cpu" or memory_limit is None or max_batch is not None:
        return
    available = available_host_bytes()
    if available is None or memory_limit <= available:
        return
    raise ValueError(
        f"memory_limit={format_bytes(memory_limit)} on the CPU is a simulated budget whose trials hold that much host "
        f"memory for real, and this machine has {format_bytes(available)} available: give a smaller memory_limit "
        "(or max_batch, to keep the trials below it), strategy='estimate' (no trial: fake tensors), or probe "
        "on the accelerator"
    )
