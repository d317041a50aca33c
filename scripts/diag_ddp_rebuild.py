"""DDP's bucket rebuilds and a step's memory, in a one-process group (run under torchrun).

An 8-block MLP (width 1024/4096, AdamW, gradients 256 MiB) wrapped in DDP, under a per-process
cap: each step's allocated peak, and what is allocated after it, at ``--batch``, first from a new
wrapper (DDP rebuilds its buckets in the second step's forward), then after a step that ran out
of memory in backward and the reducer's recovery. ``--mode ddp`` is DDP's own recovery
(``reducer._reset_state()``: the rebuild in a later forward); ``--mode autobatch`` is
``autobatch.probe.snapshot.ddp_reducer.reset_failed_reduction`` (the rebuild at once, between steps). ``--probe`` also runs
``find_max_batch`` on a ``TrainStep`` of the same model and prints its answer and trials, and
the same model without DDP for comparison::

    torchrun --nproc-per-node 1 scripts/diag_ddp_rebuild.py --mode ddp --batch 2000
    torchrun --nproc-per-node 1 scripts/diag_ddp_rebuild.py --mode autobatch --batch 2000 --probe
    torchrun --nproc-per-node 1 scripts/diag_ddp_rebuild.py --mode ddp --batch 2000 --pause 1.2
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist
from torch import nn

import autobatch
from autobatch.memory.units import parse_bytes
from autobatch.probe.snapshot.ddp_reducer import reset_failed_reduction

MiB = 2**20


def build(ddp: bool, device: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(8)])
    model = model.to(device)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def loss_fn(model, batch):
    return model(batch).float().pow(2).mean()


def steps(model, optimizer, batch: int, count: int, mode: str, device: torch.device, label: str,
          pause: float = 0.0) -> list[dict]:
    rows = []
    for index in range(count):
        torch.cuda.reset_peak_memory_stats()
        start, ok = torch.cuda.memory_allocated(), True
        try:
            loss_fn(model, torch.randn(batch, 1024, device=device)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            ok = False
        if not ok:  # outside the handler: the error's frames are gone
            optimizer.zero_grad(set_to_none=True)
            if mode == "autobatch":
                reset_failed_reduction(model)
            else:
                model.reducer._reset_state()
            gc.collect()
            torch.cuda.empty_cache()
        rows.append({"phase": label, "step": index, "batch": batch, "ok": ok, "start_mib": start // MiB,
                     "peak_mib": torch.cuda.max_memory_allocated() // MiB, "after_mib": torch.cuda.memory_allocated() // MiB})
        if pause:  # let a collective's tensors, held until NCCL's watchdog sees it complete, go before the next step
            torch.cuda.synchronize(device)
            time.sleep(pause)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ddp", "autobatch"], default="autobatch")
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--fail-batch", type=int, default=6000)
    parser.add_argument("--cap", default="2GiB")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to wait after each step")
    parser.add_argument("--runner", type=int, default=0, help="also train a new wrapper with the Runner at this micro-batch")
    args = parser.parse_args()
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    if args.probe:
        for ddp in (True, False):
            model, optimizer = build(ddp, device)
            step = autobatch.TrainStep(model, optimizer, loss_fn, lambda n: torch.randn(n, 1024, device=device))
            found = autobatch.find_max_batch(step, memory_limit=args.cap, cache=False)
            print(json.dumps({"probe": "ddp" if ddp else "bare", "answer": found.batch_size, "seconds": round(found.elapsed_s, 2),
                              "trials": [(t.batch_size, t.purpose, t.passed) for t in found.trials]}))
            del model, optimizer, step, found
            gc.collect()
            torch.cuda.empty_cache()
    model, optimizer = build(True, device)
    capacity = parse_bytes(args.cap)
    torch.cuda.set_per_process_memory_fraction(capacity / torch.cuda.get_device_properties(0).total_memory)
    rows = steps(model, optimizer, args.batch, 4, args.mode, device, "new wrapper", args.pause)
    rows += steps(model, optimizer, args.fail_batch, 1, args.mode, device, "a failure", args.pause)
    rows += steps(model, optimizer, args.batch, 5, args.mode, device, "after the failure", args.pause)
    for row in rows:
        print(json.dumps({"mode": args.mode, **row}))
    if args.runner:  # a new process's run from a cached answer: a new wrapper, trained at once
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
        model, optimizer = build(True, device)
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=args.runner, micro_batch=args.runner, progress=False)
        result = runner.fit([torch.randn(args.runner, 1024) for _ in range(20)], epochs=1)
        print(json.dumps({"runner": args.runner, "steps": result.steps, "peak_mib": torch.cuda.max_memory_allocated() // MiB,
                          "recoveries": [(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"])
                                         for r in result.oom_recoveries]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
