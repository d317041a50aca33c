"""What a read of the CUDA allocator's peak costs (issue 16, diagnostics): the nested reader
the peak guard uses (``torch._C._accelerator_getDeviceStats``) against the public
``torch.cuda.max_memory_allocated``, per call on the host, and whether the nested read waits
for queued kernels (it should not: a guard reads it inside the backward pass).

    python scripts/diag_stats_readers.py        (GPU; on an H200 host: 11 us against 80 us, no wait)
"""

from __future__ import annotations

import time

import torch


def per_call_us(read, calls: int = 1000) -> float:
    for _ in range(10):
        read()
    began = time.perf_counter()
    for _ in range(calls):
        read()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda", 0)
    torch.empty(1, device=device)  # the allocator initialised
    readers = {
        "nested": lambda: torch._C._accelerator_getDeviceStats(0)["allocated_bytes"]["all"]["peak"],
        "public": lambda: torch.cuda.max_memory_allocated(device),
    }
    for name, read in readers.items():
        print(f"{name}: {per_call_us(read):.1f} us per call")
    work = torch.randn(8192, 8192, device=device)
    torch.cuda.synchronize()
    for _ in range(20):  # ~0.4 s of queued matmuls
        work = work @ work
        work = work / work.norm()
    began = time.perf_counter()
    readers["nested"]()
    read_ms = (time.perf_counter() - began) * 1e3
    began = time.perf_counter()
    torch.cuda.synchronize()
    queue_ms = (time.perf_counter() - began) * 1e3
    print(f"nested read with kernels queued: {read_ms:.2f} ms; the queue then took {queue_ms:.0f} ms")


if __name__ == "__main__":
    main()
