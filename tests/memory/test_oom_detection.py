"""is_oom_error against a table of real allocator messages, and what must not match."""

import pytest
import torch

from autobatch import NoBatchFitsError, is_oom_error

OOM_MESSAGES = [
    # CUDA caching allocator (torch >= 2.1 raises torch.OutOfMemoryError; older a RuntimeError)
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
    "1.25 GiB is free. Including non-PyTorch memory, this process has 77.85 GiB memory in use.",
    # asynchronous CUDA error surfaced at a later synchronisation
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, "
    "so the stacktrace below might be incorrect.",
    "CUDA driver error: out of memory",  # expandable segments' cuMemCreate (review 19)
    "Triton Error [CUDA]: out of memory",  # a compiled kernel's launch
    "HIP out of memory. Tried to allocate 1.53 GiB. GPU 0 has a total capacity of 63.98 GiB",
    "HIP error: hipErrorOutOfMemory",
    "MPS backend out of memory (MPS allocated: 17.01 GB, other allocations: 1.52 GB, max allowed: 18.13 GB). "
    "Tried to allocate 256.00 MB on private pool.",
    "Invalid buffer size: 5.12 GB",
    "XPU out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.56 GiB total capacity)",
    "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 429496729600 bytes. Error code 12 (Cannot allocate memory)",
    "[enforce fail at C:\\cb\\pytorch_1000000000000\\work\\c10\\core\\impl\\alloc_cpu.cpp:72] data. "
    "DefaultCPUAllocator: not enough memory: you tried to allocate 1073741824 bytes.",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity)",
    "MLU out of memory. Tried to allocate 2.00 GiB",
    "MUSA out of memory. Tried to allocate 2.00 GiB",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::2147483648 (2048)MB",
    "Some future device out of memory. Tried to allocate 1.00 GiB",  # Accelerate's " out of memory."
]

NOT_OOM_MESSAGES = [
    "mat1 and mat2 shapes cannot be multiplied (64x100 and 200x10)",
    "CUDA error: device-side assert triggered",
    "CUDA error: an illegal memory access was encountered",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "index 12 is out of bounds for dimension 0 with size 4",
    "Trying to resize storage that is not resizable",
    "DataLoader worker (pid 123) is killed by signal: Killed.",
    "Caught an error: value out of range",
    "",
]


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_runtime_errors_with_allocator_messages_are_oom(message):
    assert is_oom_error(RuntimeError(message))


@pytest.mark.parametrize("message", OOM_MESSAGES[:3])
def test_torch_out_of_memory_error_is_oom(message):
    assert is_oom_error(torch.OutOfMemoryError(message))
    assert is_oom_error(torch.OutOfMemoryError())


@pytest.mark.parametrize("message", NOT_OOM_MESSAGES)
def test_other_runtime_errors_are_not_oom(message):
    assert not is_oom_error(RuntimeError(message))


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("CUDA out of memory"),  # right words, wrong type: not from an allocator
        KeyboardInterrupt(),
        MemoryError("plain Python MemoryError"),
        NoBatchFitsError(1, 100, 50, "cpu"),
        TypeError("bad"),
    ],
)
def test_non_runtime_errors_are_not_oom(exc):
    assert not is_oom_error(exc)


def test_real_cpu_allocator_failure_is_oom():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    assert is_oom_error(info.value)


@pytest.mark.parametrize("message, expected", [
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB of which 3.44 MiB is "
     "free. Including non-PyTorch memory, this process has 79.14 GiB memory in use. Of the allocated memory 78.25 GiB "
     "is allocated by PyTorch, and 409.95 MiB is reserved by PyTorch but unallocated.", int(78.25 * 2**30)),
    ("Simulated out of memory: tried to allocate 2.00 MiB in aten.mm.default; the simulated device has a budget of "
     "40.00 MiB, 38.32 MiB already in use, 1.68 MiB free (autobatch.simulated_memory).", int(38.32 * 2**20)),
    ("CUDA out of memory (injected by autobatch at step 1, phase forward)", None),
    (None, None),
])
def test_the_bytes_allocated_at_the_failure_are_read_from_the_message(message, expected):
    from autobatch.memory.oom import allocated_at_failure

    assert allocated_at_failure(message) == expected


def test_at_least_as_wide_as_accelerates_should_reduce_batch_size():
    """A drop-in for Accelerate's decorator retries every error Accelerate's retries."""
    memory = pytest.importorskip("accelerate.utils.memory")
    for message in OOM_MESSAGES + NOT_OOM_MESSAGES:
        if memory.should_reduce_batch_size(RuntimeError(message)):
            assert is_oom_error(RuntimeError(message)), message
