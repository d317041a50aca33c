"""is_oom_error on the allocator failures of CUDA libraries that the first table missed, and on the
errors it must leave alone (NCCL, ambiguous cuDNN statuses, wrappers of an OOM)."""

import pytest
import torch

from autobatch import is_oom_error
from autobatch.errors import PeerFailedError


def _raised_from(oom: BaseException, *, explicit: bool) -> RuntimeError:
    """A RuntimeError raised while handling ``oom``: ``from`` it, or just inside its handler."""
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as caught:
            if explicit:
                raise RuntimeError("rank 0 failed inside DDP's bucket rebuild; this cannot be replayed") from caught
            raise RuntimeError("the fallback failed: mat1 and mat2 shapes cannot be multiplied")
    except RuntimeError as wrapper:
        return wrapper


CASES = [  # (error, is it an OOM)
    (RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"), True),
    (RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`. "), True),
    (RuntimeError("CUDA error: HIPBLAS_STATUS_ALLOC_FAILED when calling `hipblasCreate(handle)`"), True),
    (RuntimeError("Unable to find a valid cuDNN algorithm to run convolution"), True),
    (torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
                            "other API call\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), False),  # ambiguous: not retried into "nothing fits"
    (torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
        "\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nFailed to CUDA calloc 10485760 bytes"),
     False),  # a collective the other ranks are inside: no replay on this rank
    (_raised_from(torch.OutOfMemoryError("CUDA out of memory"), explicit=True), False),
    (_raised_from(torch.OutOfMemoryError("CUDA out of memory"), explicit=False), False),
    (PeerFailedError("rank 1 failed: cuFFT error: CUFFT_ALLOC_FAILED", [1]), False),
    (ValueError("config out of memory budget"), False),
    (MemoryError("host memory"), False),
]


@pytest.mark.parametrize("error, expected", CASES, ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None)
def test_is_oom_error_table(error, expected):
    assert is_oom_error(error) is expected, str(error)
