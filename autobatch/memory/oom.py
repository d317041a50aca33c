"""Recognise out-of-memory errors on every backend, and give memory back after one.

Two rules from the field:

* Only allocator failures count. A shape error at batch 1 or a ``KeyboardInterrupt`` is the
  user's problem and must propagate unchanged, so detection is a fixed, tested table of the
  messages each backend's allocator produces, plus ``torch.OutOfMemoryError`` itself. It is
  at least as wide as Accelerate's ``should_reduce_batch_size`` (a drop-in for its decorator
  must retry every error that one retries: NPU, MLU, MUSA and HPU allocators included).
* Free memory *after* leaving the ``except`` block. While the exception is being handled its
  traceback pins every frame of the failed step, and with them the activations; collecting
  garbage inside the handler frees nothing (pytorch/pytorch#18853).
"""

from __future__ import annotations

import gc
import re
import threading

import torch

from .simulated import host_memory
from .units import parse_bytes

__all__ = ["is_oom_error", "free_memory", "requested_bytes", "allocated_at_failure", "allocated_resolution", "recognised_ooms", "OOM_MESSAGES"]

#: Substrings of allocator failure messages that count as "out of memory", by backend.
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # CUDA caching allocator (older releases raise RuntimeError)
    "CUDA error: out of memory",  # asynchronous CUDA error surfaced at a later sync
    # the driver API's: the allocator under expandable_segments mapping a segment (cuMemCreate),
    # and Triton's driver launching a compiled kernel (torch.compile's)
    "CUDA driver error: out of memory",
    "Triton Error [CUDA]: out of memory",
    "HIP out of memory",  # ROCm caching allocator
    "hipErrorOutOfMemory",  # ROCm runtime error code
    "MPS backend out of memory",  # Apple MPS allocator
    "Invalid buffer size",  # MPS: a single buffer larger than the device allows
    "XPU out of memory",  # Intel XPU allocator
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator, Linux
    "DefaultCPUAllocator: not enough memory",  # CPU allocator, Windows
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN under memory pressure (Lightning treats it so)
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
    "_ALLOC_FAILED",  # any CUDA library's allocation: cuFFT's CUFFT_ALLOC_FAILED, CUSOLVER_STATUS_, HIPBLAS_STATUS_...
    # PyTorch's cuDNN v7 convolution after every algorithm failed, their workspaces above all (it
    # catches each one's OutOfMemoryError and moves on): users fix it by a smaller batch
    "Unable to find a valid cuDNN algorithm to run convolution",
    "NPU out of memory",  # Ascend NPU (torch_npu) caching allocator
    "MLU out of memory",  # Cambricon MLU (torch_mlu)
    "MUSA out of memory",  # Moore Threads MUSA (torch_musa)
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # Habana Gaudi (HPU)
    " out of memory.",  # any "<DEVICE> out of memory." allocator: Accelerate's generic pattern
)


def is_oom_error(exc: BaseException) -> bool:
    """Tell whether ``exc`` is an out-of-memory failure of a device allocator.

    True for ``torch.OutOfMemoryError`` (any device, and autobatch's simulated device) and for
    ``RuntimeError``s whose message is one of :data:`OOM_MESSAGES`. Everything else, including
    ``MemoryError`` raised by autobatch itself when nothing fits, and its errors between ranks
    (``PeerFailedError``, ``RankDisagreementError``: their messages may quote another rank's OOM), is False.

    Only ``exc`` itself is read, never its ``__cause__`` or ``__context__``: an error raised while
    handling an OOM is that handler's own failure, and one raised ``from`` an OOM says what the OOM
    means there (autobatch's DDP sync raises one to say a collective's OOM cannot be replayed). A
    plain Python ``MemoryError`` is host memory (data loading), not the device allocator. NCCL's
    allocation failures ("Failed to CUDA calloc") fail a collective the other ranks are inside,
    which no retry on this rank can replay, so they propagate as they are.
    Messages that are ambiguous (``CUDNN_STATUS_INTERNAL_ERROR``) are not OOMs: a real error must
    not be retried into "nothing fits".
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return _recognised(exc)
    if not isinstance(exc, RuntimeError) or not exc.args or getattr(exc, "quotes_peers", False):
        return False  # autobatch's errors between ranks quote another rank's message: not this rank's OOM
    message = str(exc.args[0])
    return any(marker in message for marker in OOM_MESSAGES) and _recognised(exc)


class _Recognised(threading.local):
    """Out-of-memory errors :func:`is_oom_error` recognised in this thread, each counted once."""

    count = 0


_RECOGNISED = _Recognised()


def _recognised(exc: BaseException) -> bool:
    """Count ``exc`` once (a mark on the error: a handler and the one around it read the same
    error) in :func:`recognised_ooms`; True."""
    if not getattr(exc, "_autobatch_recognised", False):
        try:
            exc._autobatch_recognised = True  # type: ignore[attr-defined]
        except AttributeError:  # an error type without attributes: counted each time
            pass
        _RECOGNISED.count += 1
    return True


def recognised_ooms(add: int = 0) -> int:
    """How many out-of-memory errors this thread's handlers recognised (:func:`is_oom_error`:
    the probe's trials, the runner's replays, a decorated call's retries, a user's own check),
    after adding ``add``. Read against the device's own count of errors (CUDA's ``num_ooms``)
    it tells errors something else caught: the decorator's warning for a function that caught
    its own."""
    _RECOGNISED.count += add
    return _RECOGNISED.count


def free_memory(generation: int = 2) -> None:
    """Collect garbage and return the device allocator's unused cached blocks to the driver.

    Call it outside any ``except`` block that handled the OOM, after dropping references to
    the failed batch. It frees nothing that is still referenced.

    ``generation`` is ``gc.collect``'s: 2 (default) collects everything; 1 only the young
    generations. After a failed step 1 is enough: the frames and traceback that could hold
    its tensors in a cycle were created when the error was raised, so they are young, and a
    full collection of a process with a large heap (torchvision or transformers imported)
    costs ~0.12 s (measured on an H200 host) per failed trial.

    First it drains the autograd engine (:func:`_drain_autograd`): a backward that raised leaves
    the nodes it had queued on this thread, and through them the rest of its graph, alive until
    the next backward on the thread, which no collection frees.
    """
    _drain_autograd()
    gc.collect(generation)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return
    if accelerator.current_accelerator().type == "cuda" and not torch.cuda.is_initialized():
        return  # nothing cached yet; do not create a CUDA context just to empty it
    accelerator.empty_cache()


def _drain_autograd() -> None:
    """Run a one-element backward on this thread, so the engine drops what a failed backward left.

    Why: the autograd engine runs a backward's CPU work on the calling thread, from a ready queue
    that thread keeps. A backward that raised part-way (out of memory in ``threshold_backward``)
    leaves the tasks it had queued there, each holding its node, so the graph upstream of them and
    its saved activations stay alive until the thread's next backward, which pops and discards
    them. Measured on the simulated device (a top-2 mixture-of-experts step, an OOM in its
    backward): 27 KiB of a 55 KiB budget stayed allocated after every reference was dropped and
    ``gc.collect()`` ran, and one tiny backward freed it; a runner sized its replay on that figure
    (59 -> 22). The calling thread runs a backward's CPU work; whether a CUDA backward's device
    threads keep anything so was not measured (the drain costs microseconds either way)."""
    # host memory: with a simulated budget full (what the caller is about to free), its 4 bytes ran out of memory
    with host_memory(), torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True, device="cpu")  # not a default device set elsewhere
        (leaf * 1.0).backward()


_REQUESTED = re.compile(r"[Tt]ried to allocate\s*([0-9.]+)\s*([KMGT]i?B|B|bytes)")


def requested_bytes(message: str | None) -> int | None:
    """The allocation an OOM message says failed ("Tried to allocate 2.00 GiB"; the simulated
    device's "tried to allocate 3.00 MiB"), or None when the message does not say. The MPS
    allocator writes powers of 1024 as "KB", "MB" and "GB" ("Tried to allocate 256.00 MB on
    private pool"): read as such, not as powers of 1000 (5 % low at GB)."""
    binary = "MPS backend out of memory" in (message or "")
    return _bytes_of(_REQUESTED.search(message or ""), binary=binary)


_ALLOCATED = re.compile(r"([0-9.]+)\s*([KMGT]i?B|B|bytes)\s+(?:is allocated by PyTorch|already in use)")


def allocated_at_failure(message: str | None) -> int | None:
    """The bytes an OOM message says were allocated when the allocation failed (CUDA's "Of the
    allocated memory 78.25 GiB is allocated by PyTorch"; the simulated device's "38.32 MiB
    already in use"), or None. Read at the failure itself: temporaries that only the failed
    expression held are freed while the error unwinds, before any handler can measure."""
    return _bytes_of(_ALLOCATED.search(message or ""))


def allocated_resolution(message: str | None) -> int:
    """The bytes one step of the last digit of :func:`allocated_at_failure`'s figure stands for
    ("1.14 MiB": 0.01 MiB, 10486 bytes; "78.25 GiB": 10 MiB), 0 where the message gives none. Why:
    the figure is rounded to it, so figures read at failures of different sizes are off by up to
    half of it each (:func:`~autobatch.integrations.decorator_fixed.fixed_point` allows for that)."""
    match = _ALLOCATED.search(message or "")
    if match is None:
        return 0
    unit = parse_bytes(f"1{'B' if match.group(2) == 'bytes' else match.group(2)}", name="error")
    return max(1, round(unit * 10.0 ** -len(match.group(1).partition(".")[2])))


def _bytes_of(match: "re.Match[str] | None", *, binary: bool = False) -> int | None:
    """The bytes a message's figure says (number, unit), or None; ``binary``: "MB" means MiB."""
    if match is None:
        return None
    unit = "B" if match.group(2) == "bytes" else match.group(2)
    if binary and len(unit) == 2:  # KB, MB, GB, TB
        unit = unit[0] + "iB"
    try:
        return parse_bytes(f"{match.group(1)}{unit}", name="error")
    except ValueError:
        return None
