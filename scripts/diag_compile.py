"""A torch.compile'd model at one size: what each step allocates, by form (issue 16, diagnostics).

One new process per call: builds bench_promise's workload under ``torch.compile``, then runs
``--steps`` steps at ``--batch`` as a ``TrainStep`` called directly (what a probe's trial runs),
as the ``Runner`` (what trains a ``TrainStep``'s answer) or as a plain loop, and prints each
step's allocated and reserved peak, split bytes, allocator retries and dynamo's graph count, or
where it ran out of memory.

    python scripts/diag_compile.py --workload gpt2 --form trainstep --batch 6 --steps 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
import bench_promise  # noqa: E402


def figures(step: int) -> dict:
    stats = torch.cuda.memory_stats()
    from torch._dynamo.utils import counters
    return {"step": step, "peak_mib": round(stats["allocated_bytes.all.peak"] / 2**20, 1),
            "reserved_mib": round(stats["reserved_bytes.all.current"] / 2**20, 1),
            "split_mib": round(stats["inactive_split_bytes.all.current"] / 2**20, 1),
            "retries": stats["num_alloc_retries"], "graphs": counters["stats"]["unique_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="gpt2")
    parser.add_argument("--form", choices=("trainstep", "runner", "plain"), default="trainstep")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--eager", action="store_true", help="the same without torch.compile")
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(model, dynamic=True)")
    args = parser.parse_args()
    bench_promise.COMPILE = False if args.eager else "dynamic" if args.dynamic else True
    limit = autobatch.parse_bytes(args.memory_limit)
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    model, optimizer, loss_fn, make, dtype, _ = bench_promise.build(args.workload, "cuda", False)
    if args.form == "runner":
        data = [make(args.batch).cpu() for _ in range(2)]
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=args.batch, micro_batch=args.batch,
                                  autocast_dtype=dtype, progress=False, grow_after=None)
        result = runner.fit(data * (args.steps // 2 + 1), steps=args.steps)
        print(json.dumps({"form": "runner", "steps": result.steps, "recoveries": result.oom_recoveries,
                          "final": figures(result.steps)}, default=str))
        return
    step = (autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype) if args.form == "trainstep"
            else bench_promise.plain_step(model, optimizer, loss_fn, make, dtype, "cuda"))
    for i in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        try:
            step(args.batch)
        except torch.OutOfMemoryError as exc:
            print(json.dumps({"form": args.form, "oom_at": i, "error": str(exc)[:200], **figures(i)}))
            return
        print(json.dumps({"form": args.form, **figures(i)}))


if __name__ == "__main__":
    main()
