"""Where a probe of one workload spends its time, and what the allocator's segments hold (issue 16,
diagnostics): the probe's trial log with timestamps, and the caching allocator's largest segments
(size, bytes allocated in them) after the warm-up, after the model is built and after the probe.

    python scripts/diag_family_probe.py --workload r3d18 --form trainstep --memory-limit 8GiB
    python scripts/diag_family_probe.py --device cpu --quick --workload vae --form plain

Each line of the trial log is the probe's own ``trial ...`` log record, stamped with the seconds
since the probe began; ``--segments`` prints the segments at each point (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from autobatch.memory.devices import memory_for  # noqa: E402
from bench_promise import build, plain_step, warm_up  # noqa: E402


def segments(label: str, device: str, top: int = 6) -> None:
    """The largest segments: total and allocated MiB, and the free pieces in each."""
    if not device.startswith("cuda"):
        return
    rows = []
    for seg in torch.cuda.memory_snapshot():
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        rows.append((seg["total_size"] >> 20, seg["allocated_size"] >> 20, len(seg["blocks"]),
                     sorted(free, reverse=True)[:3]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"[segments {label}] {len(rows)} segments, {total} MiB reserved; largest (MiB total, MiB allocated, "
          f"blocks, largest free pieces in bytes): {rows[:top]}", flush=True)


class Stamped(logging.Handler):
    def __init__(self, began: list[float]):
        super().__init__()
        self.began = began

    def emit(self, record: logging.LogRecord) -> None:
        print(f"  +{time.perf_counter() - self.began[0]:7.2f}s {record.getMessage()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--form", choices=("trainstep", "plain"), default="trainstep")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--segments", action="store_true")
    parser.add_argument("--steps", type=int, default=0, help="train steps at the answer after the probe")
    args = parser.parse_args()
    began = [time.perf_counter()]
    logger = logging.getLogger("autobatch")
    logger.setLevel(logging.INFO)
    logger.addHandler(Stamped(began))
    cap = autobatch.parse_bytes(args.memory_limit) if args.device != "cpu" else None
    if not args.no_warm_up:
        warm_up(args.workload, args.device, args.quick)
    if args.segments:
        segments("after warm-up", args.device)
    model, optimizer, loss_fn, make, dtype, _ = build(args.workload, args.device, args.quick)
    if args.segments:
        segments("model built", args.device)
    fn = (autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype) if args.form == "trainstep"
          else plain_step(model, optimizer, loss_fn, make, dtype, args.device))
    began[0] = time.perf_counter()
    if args.device == "cpu":
        with autobatch.simulated_memory(args.memory_limit):
            result = autobatch.find_max_batch(fn, cache=False)
    else:
        result = autobatch.find_max_batch(fn, memory_limit=cap, device=args.device, cache=False)
    seconds = time.perf_counter() - began[0]
    print(json.dumps({"workload": args.workload, "form": args.form, "batch": result.batch_size,
                      "seconds": round(seconds, 2), "trials": result.num_trials, "notes": result.notes}), flush=True)
    for trial in result.trials:  # each trial's steps, seconds, flushing steps and wall; why a failed one failed
        mib = lambda value: None if value is None else round(value / 2**20)  # noqa: E731
        print(f"  trial {trial.batch_size} ({trial.purpose}, {'passed' if trial.passed else 'failed'}, {trial.steps} "
              f"steps, {trial.seconds:.2f} s, flushes {trial.flushes}, step peak {mib(trial.step_peak_bytes)} MiB, "
              f"reserved {mib(trial.reserved_bytes)} MiB, split {mib(trial.inactive_split_bytes)} MiB, wall "
              f"{mib(trial.wall_bytes)} MiB){': ' + ' '.join(trial.error.split())[:240] if trial.error else ''}")
    if args.segments:
        segments("after the probe", args.device)
    if args.steps and args.device != "cpu":
        with memory_for(torch.device(args.device), cap):
            step = fn if args.form == "plain" else plain_step(model, optimizer, loss_fn, make, dtype, args.device)
            for i in range(args.steps):
                step(result.batch_size)
                if args.segments and i in (0, 1, args.steps - 1):
                    segments(f"train step {i + 1}", args.device)


if __name__ == "__main__":
    main()
