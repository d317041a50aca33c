"""A plain callable probed with ``restore``, zeroing its gradients at the top of the step (so they live
between steps, as in training from the second step on): its answer, time and a run at the answer
(issue 16, diagnostics; the trial after a failed one begins with the gradients the failed one began
with, ``autobatch.probe.snapshot.failed_grads``).

    python scripts/diag_restore_grads.py --workload resnet50 --steps 50
    python scripts/diag_restore_grads.py --device cpu --quick --memory-limit 64MiB
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from bench_promise import build, warm_up  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet50")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    warm_up(args.workload, args.device, args.quick)
    model, optimizer, loss_fn, make, dtype, _ = build(args.workload, args.device, args.quick)

    def step(batch_size: int) -> None:  # zero_grad first: the last step's gradients live until here
        optimizer.zero_grad()
        with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, make(batch_size))
        loss.backward()
        optimizer.step()

    cap = autobatch.parse_bytes(args.memory_limit)
    began = time.perf_counter()
    if args.device == "cpu":
        budget = autobatch.simulated_memory(cap)
        budget.__enter__()
        result = autobatch.find_max_batch(step, restore=(model, optimizer), cache=False)
    else:
        result = autobatch.find_max_batch(step, restore=(model, optimizer), memory_limit=cap, device=args.device,
                                          cache=False)
    seconds = time.perf_counter() - began
    trials = [(t.batch_size, t.passed, t.steps, t.purpose, round(t.seconds, 2)) for t in result.trials]
    oom_at = None
    if args.device == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        for i in range(args.steps):
            step(result.batch_size)
    except torch.OutOfMemoryError:
        oom_at = i
    print(json.dumps({"workload": args.workload, "batch": result.batch_size, "seconds": round(seconds, 2),
                      "trials": trials, "steps": args.steps, "oom_at": oom_at}), flush=True)


if __name__ == "__main__":
    main()
