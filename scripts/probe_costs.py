#!/usr/bin/env python
"""Where a probe's time goes, and the memory curves its fit sees (a GPU diagnostic).

For each model of ``bench_probe.py`` (fresh process each), under the same memory cap:
the cost of the snapshot, the restore and the diagnostics; the first trial (3 steps at
batch 1, where start-up costs land); then for each batch size, as the probe would run a
trial (cache emptied, peak reset): the first step's time (a new shape: cuDNN builds its
plans), a second step's time at the same size, the allocated peak of the whole step, the
peak up to the end of backward (before the optimizer step), and the memory resident before.

    python scripts/probe_costs.py --models resnet50 gpt2 --out probe_costs.json

The curves let a fit's ladder be judged offline: what a line through any two sizes predicts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SIZES = {
    "resnet50": [2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 360],
    "gpt2": [2, 3, 4, 5, 6, 7, 8, 9, 10],
    "mlp": [2, 8, 64, 512],
}


def measure(model_name: str, device: str, limit: str) -> dict:
    import torch

    import autobatch
    from autobatch.memory.diagnostics import memory_diagnostics
    from autobatch.memory.devices import memory_for, resolve_device
    from autobatch.probe.snapshot.restore import Snapshot
    from bench_probe import build, set_cap

    model, make_batch, loss_fn, autocast = build(model_name, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = autobatch.TrainStep(model, optimizer, loss_fn, make_batch, autocast_dtype=autocast)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    set_cap(device, autobatch.parse_bytes(limit))
    sync()
    out: dict = {"model": model_name, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}

    began = time.perf_counter()
    snapshot = Snapshot.take(model, optimizer)
    out["snapshot_take_s"] = time.perf_counter() - began

    def peak_before_optimizer() -> int:
        return torch.cuda.max_memory_allocated() if device == "cuda" else 0

    def one_step(batch: int) -> tuple[float, int]:
        """A TrainStep, reading the allocated peak at the end of backward."""
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        data = make_batch(batch)
        with step.autocast():
            loss = loss_fn(model, data)
        loss.backward()
        backward_peak = peak_before_optimizer()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - began, backward_peak

    with memory_for(resolve_device(device), None) as (memory, _):
        rows = []
        for index, batch in enumerate([1] + SIZES[model_name]):
            began = time.perf_counter()
            memory.release_cached()
            memory.reset_peak()
            resident = memory.allocated()
            prepare_s = time.perf_counter() - began
            try:
                times, backward_peaks = zip(*[one_step(batch) for _ in range(3 if index == 0 else 2)])
            except torch.OutOfMemoryError:
                rows.append({"batch": batch, "passed": False})
                autobatch.free_memory()
                break
            rows.append({
                "batch": batch, "passed": True, "prepare_s": prepare_s, "step_s": list(times),
                "resident": resident, "peak": memory.peak(), "reserved_peak": memory.peak_reserved(),
                "backward_peak": backward_peaks[0],
            })
        began = time.perf_counter()
        memory_diagnostics(memory)
        out["diagnostics_s"] = time.perf_counter() - began
    began = time.perf_counter()
    snapshot.restore()
    sync()
    out["restore_s"] = time.perf_counter() - began
    out["rows"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50", "gpt2"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--memory-limit", default="16GiB")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(measure(args.worker, args.device, args.memory_limit)), flush=True)
        return
    results = []
    for model_name in args.models:  # a fresh process each, so start-up costs land in its first trial
        done = subprocess.run(
            [sys.executable, __file__, "--worker", model_name, "--device", args.device, "--memory-limit", args.memory_limit],
            capture_output=True, text=True, check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(done.stderr[-3000:], file=sys.stderr)
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        results.append(result)
        print(f"{model_name}: snapshot {result['snapshot_take_s']:.3f}s restore {result['restore_s']:.3f}s "
              f"diagnostics {result['diagnostics_s']:.3f}s")
        for row in result["rows"]:
            if row["passed"]:
                print(f"  batch {row['batch']:4d} prepare {row['prepare_s']:.3f}s steps "
                      + " ".join(f"{s:.3f}" for s in row["step_s"])
                      + f"  resident {row['resident'] / 2**20:8.1f} MiB peak {row['peak'] / 2**20:8.1f} MiB "
                      f"backward peak {row['backward_peak'] / 2**20:8.1f} MiB")
            else:
                print(f"  batch {row['batch']:4d} OOM")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
