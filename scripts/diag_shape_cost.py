"""What does a trial pay besides compute? (issue 16, diagnostics) A new batch shape (cuDNN and
cuBLAS choose algorithms per shape) against a cold allocator (the cache emptied, every block
cudaMalloc'ed again), one step each, synchronised, after bench_promise's warm-up:

    python scripts/diag_shape_cost.py --workloads resnet50,vit_b16 --sizes 8,136
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_promise import build, plain_step, warm_up  # noqa: E402


def timed(step, size: int, cold: bool) -> float:
    if cold:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    began = time.perf_counter()
    step(size)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="resnet50,vit_b16")
    parser.add_argument("--sizes", default="8,136")
    args = parser.parse_args()
    for name in args.workloads.split(","):
        warm_up(name, "cuda", False)
        model, optimizer, loss_fn, make, dtype, _ = build(name, "cuda", False)
        step = plain_step(model, optimizer, loss_fn, make, dtype, "cuda")
        step(2)  # Adam's state
        for size in map(int, args.sizes.split(",")):
            rows = {
                "new shape, cold allocator": timed(step, size, True),
                "same shape, warm": timed(step, size, False),
                "same shape, cold allocator": timed(step, size, True),
                "same shape, warm again": timed(step, size, False),
                "new shape (+1), warm allocator": timed(step, size + 1, False),
                "new shape (-1), warm allocator": timed(step, size - 1, False),
                "empty_cache itself": 0.0,
            }
            torch.cuda.synchronize()
            began = time.perf_counter()
            torch.cuda.empty_cache()
            rows["empty_cache itself"] = (time.perf_counter() - began) * 1e3
            print(f"{name} at {size}: " + "; ".join(f"{k} {v:.1f} ms" for k, v in rows.items()), flush=True)
        del model, optimizer, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
