"""Does an untuned trial decide what a later autotuned step runs? (issue 16, diagnostics)

PyTorch caches one cuDNN plan per convolution key, and ``cudnn.benchmark`` is not part of the
key: a shape first run untuned keeps its heuristic plan when autotuning is switched on later.
``deterministic`` and ``allow_tf32`` are part of it. Each case runs in a fresh process, ResNet-50
under a per-process cap, and reports the first and steady step times and the allocated peak:

* ``heuristic``: benchmark off throughout (the heuristic reference);
* ``tuned``: benchmark on from the first step (what a new autotuning process does);
* ``poisoned``: ``--warm`` steps untuned, then autotuning on (what a probe's search did);
* ``det``: the untuned steps with ``deterministic`` flipped, then the user's flags, autotuning;
* ``tf32``: the untuned steps with ``allow_tf32`` flipped, then the user's flags, autotuning.

A tuned phase whose first step is as fast as a steady one did not autotune (a cache hit).

    python scripts/diag_cudnn_cache.py --batch 160 --dtypes bf16,fp32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autobatch  # noqa: E402

GIB = 2**30
CASES = ("heuristic", "tuned", "poisoned", "det", "tf32")


def steps(model, optimizer, batch: int, n: int, dtype, keep_input: bool = False) -> dict:
    """``n`` training steps at ``batch``: the first step's and the median later step's seconds,
    the allocated peak of the last step, and each step's seconds and allocator retries (cache
    flushes). ``keep_input``: the input lives through backward, as in a hand loop's step."""
    times, retries = [], []
    for _ in range(n):
        before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        if not keep_input:
            del x
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        retries.append(torch.cuda.memory_stats().get("num_alloc_retries", 0) - before)
        x = None
    steady = sorted(times[1:])[len(times[1:]) // 2] if n > 1 else None
    return {"first_s": round(times[0], 3), "steady_s": None if steady is None else round(steady, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 4),
            "each_s": [round(t, 3) for t in times], "retries": retries}


def child(case: str, batch: int, dtype_name: str, limit: int, warm: int, tuned_steps: int, keep: bool = False) -> dict:
    from torchvision.models import resnet50

    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[dtype_name]
    torch.manual_seed(0)
    model = resnet50(num_classes=10).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cudnn = torch.backends.cudnn
    user = {"deterministic": cudnn.deterministic, "allow_tf32": cudnn.allow_tf32}
    row: dict = {"case": case, "dtype": dtype_name, "batch": batch}
    if case == "heuristic":
        cudnn.benchmark = False
        row["untuned"] = steps(model, optimizer, batch, warm + tuned_steps, dtype, keep)
        return row
    if case != "tuned":
        cudnn.benchmark = False
        if case == "det":
            cudnn.deterministic = not user["deterministic"]
        if case == "tf32":
            cudnn.allow_tf32 = not user["allow_tf32"]
        row["untuned"] = steps(model, optimizer, batch, warm, dtype, keep)
        cudnn.deterministic, cudnn.allow_tf32 = user["deterministic"], user["allow_tf32"]
    cudnn.benchmark = True
    row["tuned"] = steps(model, optimizer, batch, tuned_steps, dtype, keep)
    row["retries"] = torch.cuda.memory_stats()["num_alloc_retries"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=160)
    parser.add_argument("--batches", default=None, help="several sizes (comma-separated), each case at each")
    parser.add_argument("--repeat", type=int, default=1, help="new processes per case and size")
    parser.add_argument("--keep-input", action="store_true", help="the input lives through backward (a hand loop)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--limit", default="8GiB")
    parser.add_argument("--warm", type=int, default=3, help="untuned steps before autotuning is switched on")
    parser.add_argument("--tuned-steps", type=int, default=12)
    parser.add_argument("--child", default=None)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    limit = autobatch.parse_bytes(args.limit)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.dtype, limit, args.warm, args.tuned_steps, args.keep_input)))
        return
    sizes = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    for dtype in args.dtypes.split(","):
        for size in sizes:
            batch = size if dtype != "fp32" or args.batches else size // 2  # fp32 activations take twice the bytes
            for case in args.cases.split(","):
                for _ in range(args.repeat):
                    done = subprocess.run(
                        [sys.executable, __file__, "--child", case, "--dtype", dtype, "--batch", str(batch), "--limit",
                         args.limit, "--warm", str(args.warm), "--tuned-steps", str(args.tuned_steps)]
                        + (["--keep-input"] if args.keep_input else []),
                        capture_output=True, text=True, timeout=300,
                    )  # fmt: skip
                    print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-600:], flush=True)


if __name__ == "__main__":
    main()
