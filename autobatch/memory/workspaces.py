"""Library workspaces that a training step allocates but fake tensors cannot see.

cuBLAS needs a scratch workspace for its matrix products. PyTorch allocates one per cuBLAS
handle and stream through the caching allocator, keeps it for the life of the process, and
counts it in ``torch.cuda.memory_allocated``. Handles belong to threads, and a training step
multiplies matrices on two: the forward pass on the caller's thread, the backward pass on the
autograd engine's thread for the device. So a step that runs any matrix product on CUDA holds
two workspaces from its first backward on: 2 × 32 MiB on Hopper and Blackwell (compute
capability 9, 10, 12), 2 × (8 MiB + 128 KiB) on older GPUs, or what ``CUBLAS_WORKSPACE_CONFIG``
sets (``:SIZE_KiB:COUNT`` pairs, summed). Measured on an H200 (README, estimate accuracy):
without them the estimate of a transformer step was short by 64-71 MiB at every batch size.

cuDNN's convolution workspaces are not modelled: they live only during one call, and their
size depends on the algorithm cuDNN picks, which depends on the memory free at the time.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BlasThreads", "cublas_workspace_bytes", "hipblas_workspace_bytes", "release_workspaces", "workspace_bytes"]

#: aten operators that run on cuBLAS (and so hold its workspace on the thread that runs them).
BLAS_OPERATORS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot", "vdot",
    "addr", "_scaled_mm", "_int_mm",
})
_SM_WITH_32MIB = (9, 10, 12)
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


class BlasThreads(TorchDispatchMode):
    """Records which threads ran a cuBLAS-backed operator while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # noqa: D105
        if func.overloadpacket.__name__ in BLAS_OPERATORS:
            self.threads.add(threading.get_ident())
        return func(*args, **(kwargs or {}))


def cublas_workspace_bytes(compute_capability_major: int, config: str | None = None) -> int:
    """One cuBLAS workspace, as PyTorch sizes it: ``CUBLAS_WORKSPACE_CONFIG`` (``config``; the
    sum of ``SIZE`` KiB × ``COUNT`` over its ``:SIZE:COUNT`` pairs), else 32 MiB on compute
    capability 9.x, 10.x and 12.x and ``:4096:2:16:8`` (8 MiB + 128 KiB) before them."""
    if config:
        pairs = _PAIR.findall(config)
        if pairs:
            return sum(int(size) * int(count) for size, count in pairs) * 1024
    if compute_capability_major in _SM_WITH_32MIB:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def hipblas_workspace_bytes(arch: str, config: str | None = None) -> int:
    """The ROCm build's equivalent: the same config format (``HIPBLAS_WORKSPACE_CONFIG`` or
    ``ROCBLAS_WORKSPACE_CONFIG`` too), else 128 MiB on gfx94x/gfx95x and 32 MiB elsewhere."""
    if config:
        pairs = _PAIR.findall(config)
        if pairs:
            return sum(int(size) * int(count) for size, count in pairs) * 1024
    return (128 if arch.startswith(("gfx94", "gfx95")) else 32) * 1024 * 1024


def workspace_bytes(device: torch.device, blas_threads: int) -> int:
    """Bytes of cuBLAS (hipBLAS) workspace held by a step that ran matrix products on
    ``blas_threads`` threads on ``device`` (0 on anything but a CUDA/ROCm device)."""
    if device.type != "cuda" or blas_threads == 0 or not torch.cuda.is_available():
        return 0
    properties = torch.cuda.get_device_properties(device)
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if torch.version.hip:
        config = config or os.environ.get("HIPBLAS_WORKSPACE_CONFIG") or os.environ.get("ROCBLAS_WORKSPACE_CONFIG")
        return blas_threads * hipblas_workspace_bytes(getattr(properties, "gcnArchName", ""), config)
    return blas_threads * cublas_workspace_bytes(properties.major, config)


def release_workspaces(device: torch.device | None) -> bool:
    """Free the cuBLAS workspaces PyTorch keeps for the life of the process, so the next matrix
    product makes them again; whether any were freed (CUDA only, where this torch can).

    Why: a new process makes them during its first step, among that step's activations, where
    they stay; a probe's trials would otherwise all share the ones their first, small trial made,
    at the bottom of memory. Measured on an H200 (a Llama-style decoder, bf16, AdamW, 8 GiB cap,
    ``scripts/diag_fresh_layout.py --layouts trials --clear-workspaces``): with the workspaces
    kept, trials passed 5; made again in each trial's first step, 5 ran out of memory at its
    second step, as new processes resumed from a checkpoint did, and 4 passed. A matrix product
    still queued is safe: the caching allocator reuses a freed block only in stream order, and
    PyTorch hands each handle its workspace again at its next use (it does this itself before
    capturing a CUDA graph)."""
    if device is None or device.type != "cuda" or torch.version.hip or not torch.cuda.is_initialized():
        return False
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True
