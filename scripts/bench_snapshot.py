"""How fast can the probe's snapshot copy a model's parameters off the GPU? (issue 16)

The TrainStep probe copies the parameters to host memory before the first optimizer step
(:mod:`autobatch.probe.snapshot.restore`); on an H200 the first trial waited ~0.3 s for GPT-2's. Each
mode runs in a fresh process (first use of host memory, as in a probe), ``--rounds`` times:

* ``pageable``: one ``tensor.to("cpu", copy=True)`` per parameter (the current copy);
* ``pinned_flat``: one page-locked buffer for all parameters, asynchronous copies into views
  of it, one synchronisation;
* ``threaded``: the pageable copies spread over 8 threads (fresh host memory is faulted in
  page by page, and faults run in parallel).

    python scripts/bench_snapshot.py --workloads gpt2,vit_b16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def copy_pageable(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in params]


def nbytes(params: list[torch.Tensor]) -> int:
    """The bytes of ``params`` together: the size of one flat buffer for all of them."""
    return sum(p.numel() * p.element_size() for p in params)


def copy_into(params: list[torch.Tensor], flat: torch.Tensor, *, non_blocking: bool = False) -> list[torch.Tensor]:
    """Copy ``params`` into consecutive views of the byte buffer ``flat``; returns the views."""
    out, offset = [], 0
    for p in params:
        size = p.numel() * p.element_size()
        view = flat[offset:offset + size].view(p.dtype).view(p.shape)
        view.copy_(p.detach(), non_blocking=non_blocking)
        out.append(view)
        offset += size
    return out


def copy_pinned_flat(params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = copy_into(params, torch.empty(nbytes(params), dtype=torch.uint8, pin_memory=True), non_blocking=True)
    torch.cuda.synchronize()
    return out


def copy_threaded(params: list[torch.Tensor], threads: int = 8) -> list[torch.Tensor]:
    """The pageable copy spread over threads: fresh host memory is faulted in page by page,
    which is what bounds the copy, and page faults run in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    device = params[0].device

    def one(p: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(device):
            return p.detach().to("cpu", copy=True)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, params))


MODES = {"pageable": copy_pageable, "pinned_flat": copy_pinned_flat, "threaded": copy_threaded}


def child(workload: str, mode: str) -> dict:
    from bench_promise import build

    model = build(workload, "cuda", False)[0]
    params = [p for p in model.parameters()]
    torch.cuda.synchronize()
    began = time.perf_counter()
    copies = MODES[mode](params)
    seconds = time.perf_counter() - began
    assert all(torch.equal(c, p.detach().cpu()) for c, p in zip(copies, params))
    return {"workload": workload, "mode": mode, "mib": round(sum(p.numel() * p.element_size() for p in params) / 2**20),
            "tensors": len(params), "seconds": round(seconds, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt2,vit_b16,resnet50")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    for workload in args.workloads.split(","):
        for round_ in range(args.rounds):
            modes = list(MODES)
            for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
                done = subprocess.run([sys.executable, __file__, "--child", workload, mode], capture_output=True, text=True)
                print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-400:], flush=True)


if __name__ == "__main__":
    main()
