"""An optimizer step that does not fit, on the Runner: what a real out-of-memory error inside
``optimizer.step()`` costs, and whether the advice the runner gives (``foreach=False``) holds.

A stack of square linear layers trained with AdamW under a per-process cap set so that the
weights, gradients and Adam's moments fit with room for the activations, but not the temporaries
of torch's foreach AdamW step (a copy over the whole parameter list). Each run prints one JSON
line: the recoveries (step, phase, micro-batch before and after, action), the error that ended the
run, its seconds, and the peak. Run it from two checkouts to compare versions (review 34: the
runner used to halve the micro-batch after such an OOM, down to 1, before giving up).

    python scripts/diag_optimizer_oom.py --device cuda            # foreach AdamW, then foreach=False
    python scripts/diag_optimizer_oom.py --device cuda --layers 16 --width 4096 --headroom 0.5
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autobatch  # noqa: E402


def run(args: argparse.Namespace, foreach: bool) -> dict:
    """One Runner fit of ``args.steps`` global batches under the cap; its outcome as a dict."""
    device = torch.device(args.device)
    gc.collect()  # the run before: its error's frames hold its model until collected
    autobatch.free_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    cap = int(params * (4 + args.headroom))  # weights, gradients, two moments, and room for activations
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory)
    batches = [(torch.randn(args.batch, args.width, device=device), torch.randn(args.batch, args.width, device=device))
               for _ in range(args.steps)]
    runner = autobatch.Runner(model, optimizer, lambda m, b: F.mse_loss(m(b[0]), b[1]), global_batch=args.batch,
                              micro_batch=args.batch, progress=False, log_every=0)
    began, error = time.perf_counter(), None
    try:
        result = runner.fit(batches)
        recoveries, steps = result.oom_recoveries, result.steps
    except autobatch.StepOutOfMemoryError as exc:
        error, steps = str(exc)[:400], runner.step
        recoveries = runner.result.oom_recoveries
    seconds = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)
    del runner, model, optimizer, batches
    return {"foreach": foreach, "params_gib": round(params / 2**30, 3), "cap_gib": round(cap / 2**30, 3),
            "steps": steps, "seconds": round(seconds, 2), "peak_gib": None if peak is None else round(peak / 2**30, 3),
            "recoveries": [[r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"], r.get("action")]
                           for r in recoveries], "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--headroom", type=float, default=0.5, help="room above 4x the weights, in weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for foreach in (True, False):
        print(json.dumps(run(args, foreach)), flush=True)


if __name__ == "__main__":
    main()
