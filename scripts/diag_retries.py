"""How often does the allocator flush its cache, step by step, in a probe's trials and in the
training that follows? (issue 16, diagnostics)

On an H100 (8 GiB cap) ResNet-50's plain callable answered 180 (its trial: four steps, every
step after the first flushing, 26 MiB clear of the wall rule) and the hand loop that followed in
the same process ran out of memory at step 14 after 237 allocator retries; on an H200 the same
trial figures trained 200 steps. The trial records only *whether* a step flushed. This script
runs bench_promise's same-process sequence (the ``TrainStep`` probe, the Runner's steps at its
answer, then the plain callable's probe and a hand loop at its answer), reading
``num_alloc_retries`` after every call of the step, so a trial's retries per step can be set
beside those of the training that follows.

    python scripts/diag_retries.py --workloads resnet50 --steps 200
    python scripts/diag_retries.py --workloads resnet50 --forms plain --train-offset -1
    python scripts/diag_retries.py --device cpu --quick --workloads gpt2     (proves it runs)
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
from bench_promise import Capped, build, free_memory, plain_step, train_runner, warm_up  # noqa: E402


def retries(device: str) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def logged(call, calls: list, device: str, batch_size: int) -> None:
    """``call(batch_size)``, its batch size, outcome and allocator retries appended to ``calls``."""
    before = retries(device)
    try:
        call(batch_size)
    except BaseException as exc:
        calls.append((batch_size, type(exc).__name__, retries(device) - before))
        raise
    calls.append((batch_size, "ok", retries(device) - before))


class LoggedTrainStep(autobatch.TrainStep):
    """A ``TrainStep`` (so the probe snapshots, restores and cleans up as for any) that logs."""

    calls: list

    def __call__(self, batch_size: int) -> None:
        logged(super().__call__, self.calls, self.device.type, batch_size)


class LoggedStep:
    """A plain callable that logs."""

    def __init__(self, fn, device: str) -> None:
        self.fn, self.device, self.calls = fn, device, []

    def __call__(self, batch_size: int) -> None:
        logged(self.fn, self.calls, self.device, batch_size)


def train(step, batch_size: int, steps: int, device: str, limit: int) -> dict:
    """A hand loop at ``batch_size``: each step's retries, and where it ran out of memory."""
    per_step, oom_at = [], None
    with Capped(device, limit):
        for index in range(steps):
            before = retries(device)
            try:
                step(batch_size)
            except torch.OutOfMemoryError:
                oom_at = index
                break
            finally:
                per_step.append(retries(device) - before)
    return {"steps": len(per_step), "oom_at": oom_at, "retries_per_step": per_step}


def form(args, name: str, which: str, cap: int | None, limit: int) -> dict:
    """Probe one form, then train ``--steps`` steps at its answer (plus ``--train-offset``)."""
    model, optimizer, loss_fn, make, dtype, _ = build(name, args.device, args.quick)
    if which == "trainstep":
        step = LoggedTrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype)
        step.calls = []
    else:
        step = LoggedStep(plain_step(model, optimizer, loss_fn, make, dtype, args.device), args.device)
    result = autobatch.find_max_batch(step, memory_limit=cap, device=args.device, cache=False)
    free_memory()
    size = result.batch_size + args.train_offset
    if which == "trainstep":  # as bench_promise trains it: the Runner, its retries in total
        before = retries(args.device)
        ran = train_runner(model, optimizer, loss_fn, make, dtype, size, args.steps, args.device, limit)
        trained = {"steps": ran["steps"], "oom_at": ran["recoveries"] or None,
                   "retries_per_step": [retries(args.device) - before]}
    else:
        trained = train(step.fn, size, args.steps, args.device, limit)
    out = {"form": which, "batch": result.batch_size, "trained_at": size, "probe_calls": step.calls, "trained": trained}
    del model, optimizer, step
    free_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="resnet50")
    parser.add_argument("--forms", default="trainstep,plain")
    parser.add_argument("--memory-limit", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train-offset", type=int, default=0, help="train at the answer plus this (e.g. -1)")
    args = parser.parse_args()
    args.memory_limit = args.memory_limit or ("16MiB" if args.device == "cpu" else "8GiB")
    limit = autobatch.parse_bytes(args.memory_limit)
    for name in args.workloads.split(","):
        torch.backends.cudnn.benchmark = name.endswith("_tuned")
        warm_up(name, args.device, args.quick)
        if args.device == "cpu":
            with autobatch.simulated_memory(limit):
                rows = [form(args, name, which, None, limit) for which in args.forms.split(",")]
        else:
            rows = [form(args, name, which, limit, limit) for which in args.forms.split(",")]
        for row in rows:
            trained = row["trained"]
            print(json.dumps({"workload": name, "form": row["form"], "batch": row["batch"], "trained_at": row["trained_at"],
                              "probe_calls": row["probe_calls"], "trained_steps": trained["steps"],
                              "oom_at": trained["oom_at"], "train_retries_first_20": trained["retries_per_step"][:20],
                              "train_retries_total": sum(trained["retries_per_step"])}), flush=True)


if __name__ == "__main__":
    main()
