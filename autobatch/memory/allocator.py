"""The CUDA caching allocator's ``expandable_segments`` setting: whether it is on, and setting it.

With fixed segments (PyTorch's default) every large request is served from one contiguous
block of a segment the allocator got from the driver, and a segment that still holds one live
tensor cannot be returned. So a size at the edge of memory trains only while its free pieces
happen to sit where its next large request fits, and that depends on where earlier steps left
small tensors: the optimizer's state above all, which a new process creates in its first step
among that step's freed activations, where a probe's trials made it at a smaller size. Measured
on one NVIDIA H200 (issue 16, the CLI's embedded default, uncapped): the probe's 38799 passed
its trials, and in a new process step 1 asked for 18.95 GiB with 18.91 GiB reserved but
unallocated, in 3 of 3 runs. With ``expandable_segments:True`` a segment grows and shrinks by
pages (20 MiB in the large pool, 2 MiB in the small one: :data:`LARGE_PAGE_BYTES`), and on a
failed request the allocator unmaps the whole pages of its free pieces and maps them again where
the request fits, so free memory is free wherever it sits (but for the partly used pages at the
ends of a free piece) and a new process's placement cannot decide whether a size trains.

The command line turns it on for CUDA unless told otherwise (``device.expandable_segments``);
the library never changes a user's allocator, it only reads the setting (the probe cache keys
answers by it, :mod:`autobatch.probe.caching.cache`; a probe's ``promise`` records it).
"""

from __future__ import annotations

import os
import re

import torch

__all__ = ["LARGE_PAGE_BYTES", "environment_expandable_segments", "expandable_segments", "expandable_segments_on",
           "other_allocator_settings", "set_expandable_segments"]

#: the environment variables the caching allocator reads (the first is the older name)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: the page by which an expandable segment of the caching allocator's large pool (requests over
#: 1 MiB) maps and unmaps device memory (``kLargeBuffer`` in PyTorch's CUDACachingAllocator)
LARGE_PAGE_BYTES = 20 * 2**20

_SETTING = re.compile(r"expandable_segments\s*:\s*(\w+)", re.IGNORECASE)

#: what :func:`set_expandable_segments` set in this process, for torch builds that cannot report it
_set_here: bool | None = None


def _named(conf: str) -> bool | None:
    """The last ``expandable_segments:<value>`` in an allocator settings string (None: not named)."""
    found = _SETTING.findall(conf or "")
    return None if not found else found[-1].lower() == "true"


def other_allocator_settings() -> list[str]:
    """The caching allocator's settings from the environment other than ``expandable_segments``
    (``max_split_size_mb``, ``garbage_collection_threshold``, ``backend:cudaMallocAsync``, ...),
    normalised and sorted: they change where free memory sits, so the cache keys on them."""
    options = (option.strip().replace(" ", "").lower() for var in ALLOC_CONF_VARS
               for option in os.environ.get(var, "").split(","))
    return sorted({option for option in options if option and not _SETTING.match(option)})


def environment_expandable_segments() -> bool | None:
    """What ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` say (None: neither names it)."""
    named = [_named(os.environ.get(var, "")) for var in ALLOC_CONF_VARS]
    return next((value for value in reversed(named) if value is not None), None)


def expandable_segments() -> bool:
    """Whether the caching allocator makes expandable segments: the settings it was given at
    run time (torch's own record where it keeps one, else what :func:`set_expandable_segments`
    set), else the environment."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        named = _named(getter())
        if named is not None:
            return named
    if _set_here is not None:
        return _set_here
    return bool(environment_expandable_segments())


def expandable_segments_on(device: torch.device | None) -> bool | None:
    """:func:`expandable_segments` for memory on ``device``: None off CUDA, where the setting
    does not apply."""
    if getattr(device, "type", None) != "cuda":
        return None
    return expandable_segments()


def set_expandable_segments(on: bool) -> None:
    """Make the caching allocator's new segments expandable (or fixed). Segments made before
    keep their kind, so call it before the model moves to the device."""
    global _set_here
    setting = f"expandable_segments:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)
    _set_here = on
