"""How fast can a probe snapshot the weights off an accelerator, and what does it cost the
trials running beside it? (issue 16, diagnostics)

A ``TrainStep`` probe copies the parameters to host memory in a thread while its first trial
runs; the optimizer's first step (and any OOM's cache release, which synchronizes the device)
waits for that copy. For a GPT-2-sized model (475 MiB) each method here copies the weights
while a training loop runs at a small batch, in a fresh process each, and reports:
``copy_s`` (from the start until the copy is complete) and ``loop_s`` (the loop's own time,
against ``none``: no copy).

``scripts/bench_snapshot.py`` times copies alone; this script times them beside a loop. Methods:
``pageable`` (each tensor ``.to("cpu")``, what the probe did), ``flat`` (one pageable
buffer, filled tensor by tensor from the thread), ``hugepages`` (the same in a mapping advised
to use transparent huge pages), ``pinned`` (one
page-locked buffer, allocated and filled by asynchronous copies from the thread),
``pinned-main`` (the same, issued from the main thread; no Python thread).

    python scripts/diag_snapshot.py                 (GPU)
    python scripts/diag_snapshot.py --device cpu    (seconds; proves it runs)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_promise import build  # noqa: E402
from bench_snapshot import copy_into, copy_pageable, nbytes  # noqa: E402  (the copies bench_snapshot times alone)

METHODS = ("none", "pageable", "flat", "hugepages", "pinned", "pinned-main")


def _huge(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """One anonymous mapping advised to use transparent huge pages (512 times fewer page
    faults on first touch), filled tensor by tensor."""
    import mmap

    area = mmap.mmap(-1, max(nbytes(params), 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    return copy_into(params, torch.frombuffer(area, dtype=torch.uint8))


def _pinned(params: list[torch.Tensor], device: str, pin: bool = True):
    """One page-locked buffer, filled by non-blocking copies on a side stream; returns
    (views, event) where the event marks the copies' completion. ``pin=False``: one pageable
    buffer, filled by blocking copies."""
    pin = pin and device == "cuda"
    flat = torch.empty(nbytes(params), dtype=torch.uint8, pin_memory=pin)
    side = torch.cuda.Stream() if device == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else _null():
        views = copy_into(params, flat, non_blocking=pin)
        event = torch.cuda.Event() if pin else None
        if event is not None:
            event.record()
    return views, event


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def one(method: str, name: str, device: str, steps: int, batch: int) -> dict:
    model, optimizer, loss_fn, make, dtype, _ = build(name, device, device == "cpu")
    params = [p for p in model.parameters()]

    def step():
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, make(batch))
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up: kernels loaded, allocator primed
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    done = {}
    began = time.perf_counter()

    def copy_in_thread(fn):
        out = fn()
        if isinstance(out, tuple) and out[1] is not None:
            out[1].synchronize()
        sync()
        done["copy"] = time.perf_counter() - began

    thread = None
    event = None
    if method == "pageable":
        thread = threading.Thread(target=copy_in_thread, args=(lambda: copy_pageable(params),))
    elif method == "flat":
        thread = threading.Thread(target=copy_in_thread, args=(lambda: _pinned(params, device, pin=False),))
    elif method == "hugepages":
        thread = threading.Thread(target=copy_in_thread, args=(lambda: _huge(params),))
    elif method == "pinned":
        thread = threading.Thread(target=copy_in_thread, args=(lambda: _pinned(params, device),))
    elif method == "pinned-main":
        _, event = _pinned(params, device)
    if thread is not None:
        thread.start()
    loop_began = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    loop = time.perf_counter() - loop_began
    if thread is not None:
        thread.join()
    if event is not None:
        event.synchronize()
        done["copy"] = time.perf_counter() - began
    bytes_ = nbytes(params)
    return {"method": method, "workload": name, "MiB": round(bytes_ / 2**20), "loop_s": round(loop, 4),
            "copy_s": round(done.get("copy", 0.0), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default="gpt2,resnet50")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return print(json.dumps(one(args.child, args.workload, args.device, args.steps, args.batch)))
    for _ in range(args.rounds):
        for name in args.workloads.split(","):
            for method in args.methods.split(","):
                command = [sys.executable, __file__, "--child", method, "--workload", name, "--device", args.device,
                           "--steps", str(args.steps), "--batch", str(args.batch)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-500:], flush=True)


if __name__ == "__main__":
    main()
