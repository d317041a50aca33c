"""Where does a cuDNN-autotuned answer run out of memory? (issue 16, diagnostics)

Each mode runs in its own process (a fresh allocator and a fresh autotuning cache):

* ``fresh``: a plain loop at ``--batch`` with ``cudnn.benchmark=True`` from the first step;
* ``late``: the same, with autotuning switched on only from the second step (after the
  optimizer's lazily created state exists);
* ``flush``: ``fresh`` with the cache emptied after the first (autotuning) step;
* ``probe``: ``find_max_batch(TrainStep)`` then a plain loop at the answer in the same process.

Per step: allocated and reserved peaks, inactive split bytes, the OOM's first line.
    python scripts/diag_autotune.py --batch 180
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autobatch  # noqa: E402

GIB = 2**30


def build():
    from torchvision.models import resnet50

    torch.manual_seed(0)
    model = resnet50(num_classes=10).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make(b):
        return torch.randn(b, 3, 224, 224, device="cuda"), torch.randint(0, 10, (b,), device="cuda")

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]).float(), batch[1])

    return model, optimizer, loss_fn, make


def loop(model, optimizer, loss_fn, make, batch: int, steps: int, late: bool = False, flush: bool = False) -> list:
    out = []
    for i in range(steps):
        if flush and i == 1:
            torch.cuda.empty_cache()  # the autotuner's workspace tries leave the cache full
        torch.backends.cudnn.benchmark = not (late and i == 0)
        torch.cuda.reset_peak_memory_stats()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model, make(batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:
            stats = torch.cuda.memory_stats()
            text = " ".join(str(exc).split())
            out.append({"step": i, "oom": text[:420], "retries": stats["num_alloc_retries"],
                        "alloc_now": round(stats["allocated_bytes.all.current"] / GIB, 3),
                        "reserved_now": round(stats["reserved_bytes.all.current"] / GIB, 3),
                        "split_now": round(stats.get("inactive_split_bytes.all.current", 0) / GIB, 3)})
            return out
        stats = torch.cuda.memory_stats()
        out.append({"step": i, "alloc": round(stats["allocated_bytes.all.peak"] / GIB, 3),
                    "reserved": round(stats["reserved_bytes.all.peak"] / GIB, 3), "retries": stats["num_alloc_retries"],
                    "split": round(stats.get("inactive_split_bytes.all.current", 0) / GIB, 3), "split_peak": round(stats.get("inactive_split_bytes.all.peak", 0) / GIB, 3)})
    return out


def child(mode: str, batch: int, steps: int, limit: int) -> dict:
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    model, optimizer, loss_fn, make = build()
    row: dict = {"mode": mode}
    if mode == "probe":
        torch.backends.cudnn.benchmark = True
        ts = autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=torch.bfloat16)
        import time

        started = time.perf_counter()
        result = autobatch.find_max_batch(ts, cache=False)
        row["probe_s"] = round(time.perf_counter() - started, 2)
        batch = result.batch_size
        row.update(answer=batch, trials=[(t.batch_size, t.passed, t.steps, t.purpose, (t.error or '')[:160]) for t in result.trials], promise=result.promise)
    if mode.startswith("runner"):
        out = runner(model, optimizer, loss_fn, make, batch, steps, guard=mode.partition("_")[2] or "auto")
        stats = [s for s in out if "retries" in s]
        row.update(batch=batch, steps_run=len(stats), end=out[-1], last=stats[-1] if stats else None,
                   worst=max((s["alloc"] + s["split_peak"] for s in stats[1:]), default=None),
                   flushing_steps=sum(1 for a, b in zip(stats, stats[1:]) if b["step"] >= 2 and b["retries"] > a["retries"]))
        return row
    row["batch"] = batch
    steps_out = loop(model, optimizer, loss_fn, make, batch, steps, late=mode == "late", flush=mode == "flush")
    if mode in ("fresh", "flush", "probe"):  # the summary: how many steps after the second flushed, the OOM if any
        row["flushing_steps"] = sum(1 for a, b in zip(steps_out, steps_out[1:]) if "retries" in b and b["step"] >= 2
                                    and b["retries"] > a.get("retries", 0))
        row["oom"] = [s for s in steps_out if "oom" in s]
        row["last"] = steps_out[-1]
        row["worst"] = max((s["alloc"] + s["split_peak"] for s in steps_out[1:] if "alloc" in s), default=None)
        return row
    row["steps"] = steps_out
    return row


def runner(model, optimizer, loss_fn, make, batch: int, steps: int, guard: str) -> list:
    """autobatch.Runner at ``batch`` (data on the host, as a loader gives it), stats per step."""
    import logging

    torch.backends.cudnn.benchmark = True
    data = [tuple(t.cpu() for t in make(batch)) for _ in range(2)]
    out: list = []
    errors: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            errors.append(record.getMessage()[:200])

    logging.getLogger("autobatch").addHandler(Keep())

    def on_step_end(info):
        stats = torch.cuda.memory_stats()
        out.append({"step": info["step"], "mb": info["micro_batch"], "alloc": round(stats["allocated_bytes.all.peak"] / GIB, 3),
                    "reserved": round(stats["reserved_bytes.all.peak"] / GIB, 3), "retries": stats["num_alloc_retries"],
                    "split": round(stats.get("inactive_split_bytes.all.current", 0) / GIB, 3), "split_peak": round(stats.get("inactive_split_bytes.all.peak", 0) / GIB, 3)})
        torch.cuda.reset_peak_memory_stats()

    run = autobatch.Runner(model, optimizer, loss_fn, global_batch=batch, micro_batch=batch, autocast_dtype=torch.bfloat16,
                           progress=False, grow_after=None, step_guard=guard)
    result = run.fit(data * (steps // 2 + 1), steps=steps, on_step_end=on_step_end)
    out.append({"recoveries": [(r["step"], r["phase"], r["micro_batch"], r["action"], r["error"][200:600])
                               for r in result.oom_recoveries], "log": errors[:3]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", default="180", help="one size or a comma list")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--limit", default="8GiB")
    parser.add_argument("--modes", default="fresh,late,probe")
    parser.add_argument("--child", default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode and size (fresh processes)")
    parser.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the children")
    args = parser.parse_args()
    limit = autobatch.parse_bytes(args.limit)
    if args.child:
        print(json.dumps(child(args.child, int(args.batch), args.steps, limit), default=str))
        return
    env = dict(os.environ, **({"PYTORCH_CUDA_ALLOC_CONF": args.alloc_conf} if args.alloc_conf else {}))
    for mode, batch in [(m, b) for b in args.batch.split(",") for m in args.modes.split(",")]:
        failed = []
        for _ in range(args.repeat):
            done = subprocess.run([sys.executable, __file__, "--child", mode, "--batch", batch, "--steps",
                                   str(args.steps), "--limit", args.limit], capture_output=True, text=True,
                                  timeout=300, env=env)
            print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr[-800:], flush=True)
            row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
            failed += [s["step"] for s in row.get("oom", [])]
        print(json.dumps({"summary": mode, "batch": batch, "runs": args.repeat, "oom_steps": failed,
                          "alloc_conf": args.alloc_conf}), flush=True)


if __name__ == "__main__":
    main()
