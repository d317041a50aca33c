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
    python scripts/diag_retries.py --workloads resnet50 --forms plain --relayout lazy
    python scripts/diag_retries.py --device cpu --quick --workloads gpt2     (proves it runs)

``--relayout`` moves the optimizer state the probe's trials created before the hand loop trains,
to tell whether *where* that state sits is what breaks the loop in the probing process (a new
process, whose first step creates the state among its activations, trained 180). ``none`` leaves
the probe as it is: since commit ca966d3 it parks that state itself (``autobatch.memory.parking``,
as ``pool`` below). Every other choice turns the probe's parking off first: ``keep`` then leaves
the state where the trials made it (what ``none`` measured before the parking), ``compact``
sends it to the host and back (fresh segments of its own), ``lazy`` sends it to the host and
brings it back at the loop's first optimizer step (where a new process creates it), ``drop``
forgets it (a new process's placement and values), ``swap`` leaves it in place and, at the loop's
first optimizer step, copies it into new device memory and frees the old (no host round trip);
``pinned`` is ``lazy`` through one pinned host buffer, ``pool`` is ``lazy`` through a private
device memory pool (``torch.cuda.MemPool``) instead of the host. The seconds the move off the
default pool took are printed as ``relayout_s``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

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


def relayout(optimizer: torch.optim.Optimizer, how: str, device: str) -> float:
    """Move ``optimizer``'s device state as ``--relayout`` says (values kept, except ``drop``);
    the seconds the move off the default pool took."""
    if how in ("none", "keep"):
        return 0.0
    if how == "drop":
        optimizer.state.clear()
        free_memory()
        return 0.0
    moved = [t for state in optimizer.state.values() for t in state.values()
             if isinstance(t, torch.Tensor) and t.device.type == device]
    began, keep = time.perf_counter(), None
    if how == "swap":  # stays put; new device memory for all of it at the first step, then the copies
        def back() -> None:
            fresh = [torch.empty_like(t) for t in moved]
            for tensor, new in zip(moved, fresh):
                new.copy_(tensor)
                tensor.data = new
    else:
        if how in ("compact", "lazy"):  # pageable host memory
            for tensor in moved:
                tensor.data = tensor.data.to("cpu")
        elif how == "pinned":  # one pinned host buffer, asynchronous copies
            sizes = [-(-t.numel() * t.element_size() // 512) * 512 for t in moved]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
            offset = 0
            for tensor, size in zip(moved, sizes):
                view = flat[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor, non_blocking=True)
                offset += size
                tensor.data = view
            torch.cuda.synchronize()
        elif how == "pool":  # a private device pool, out of the default pool's way
            keep = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(keep):
                for tensor in moved:
                    tensor.data = tensor.data.clone()
            torch.cuda.synchronize()
        if device == "cuda":
            torch.cuda.empty_cache()

        def back() -> None:
            for tensor in moved:
                tensor.data = tensor.data.to(device, copy=True, non_blocking=True)

    taken = 0.0 if how == "swap" else time.perf_counter() - began
    if how == "compact":
        back()
        return taken
    pending = [keep]  # the pool (if any) lives until the state is back

    def once(*_) -> None:  # stays registered: removing a hook inside torch's loop over them breaks later hooks
        if pending:
            pending.clear()
            back()

    optimizer.register_step_pre_hook(once)
    return taken


def form(args, name: str, which: str, cap: int | None, limit: int) -> dict:
    """Probe one form, then train ``--steps`` steps at its answer (plus ``--train-offset``)."""
    model, optimizer, loss_fn, make, dtype, _ = build(name, args.device, args.quick)
    if which == "trainstep":
        step = LoggedTrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype)
        step.calls = []
    else:
        step = LoggedStep(plain_step(model, optimizer, loss_fn, make, dtype, args.device), args.device)
    # every --relayout but ``none`` acts on the state where the trials left it: the probe's own
    # parking (autobatch.memory.parking, what ``pool`` measured) is turned off for them
    parking = contextlib.nullcontext() if args.relayout == "none" or which == "trainstep" else \
        mock.patch("autobatch.probe.promise.park_until_step", lambda *_: 0)
    with parking:
        result = autobatch.find_max_batch(step, memory_limit=cap, device=args.device, cache=False)
    free_memory()
    size = result.batch_size + args.train_offset
    if which == "trainstep":  # as bench_promise trains it: the Runner, its retries in total
        before = retries(args.device)
        ran = train_runner(model, optimizer, loss_fn, make, dtype, size, args.steps, args.device, limit)
        trained = {"steps": ran["steps"], "oom_at": ran["recoveries"] or None,
                   "retries_per_step": [retries(args.device) - before]}
    else:
        relayout_s = relayout(optimizer, args.relayout, args.device)
        trained = train(step.fn, size, args.steps, args.device, limit)
    out = {"relayout_s": round(relayout_s, 4) if which != "trainstep" else None, "form": which, "batch": result.batch_size, "trained_at": size, "probe_calls": step.calls, "trained": trained}
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
    parser.add_argument("--relayout", choices=["none", "keep", "compact", "lazy", "drop", "swap", "pinned", "pool"], default="none",
                        help="move the plain callable's optimizer state before its hand loop (see above)")
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
            print(json.dumps({"workload": name, "form": row["form"], "relayout": args.relayout, "relayout_s": row["relayout_s"], "batch": row["batch"], "trained_at": row["trained_at"],
                              "probe_calls": row["probe_calls"], "trained_steps": trained["steps"],
                              "oom_at": trained["oom_at"], "train_retries_first_20": trained["retries_per_step"][:20],
                              "train_retries_total": sum(trained["retries_per_step"])}), flush=True)


if __name__ == "__main__":
    main()
