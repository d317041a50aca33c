"""Where a new process's optimizer state lands, and what its steps do there (issue 16, diagnostics).

A plain callable's trials keep the optimizer state their first trial (at 8) created; a new
process creates it in its first step at the answer, among that step's freed activations. Under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` ViT-B/16's plain answer (102) trained 200
steps in the probing process and ran out of memory at step 32 in every new process, after 38
allocator retries. This script sets, step by step, what the allocator does in three layouts:

* ``fresh``: a new process, a hand loop at each ``--sizes`` from its first step;
* ``probed``: the probing process, the hand loop at the probe's answer (the trials' state kept);
* ``dropped``: the probing process, the trials' state dropped after the probe, so the loop's first
  step creates it among its activations, as a new process does;
* ``regrown``: as ``pooled`` without the pool: the state and the gradients dropped before the
  cache is returned, so the first step makes both again among its activations;
* ``pooled``: the probing process, then for each of ``--pool-offsets`` (added to the answer) the
  trials' state and gradients dropped, the cache returned, and ``--steps`` steps whose every
  allocation goes to a new private pool (``torch.cuda.MemPool``, device-wide): an allocator with
  no history for the step, as a new process's first step has it, beside the model's weights;
* ``trials``: the probe's trials by hand, in one process: 3 steps at 8 (the optimizer's state made
  there, as the probe's first trial makes it), 1 at ``--fit``, then ``--steps`` steps at each of
  ``--sizes`` in the order given, the allocator's cache returned before each, as
  :class:`~autobatch.probe.trial.TrialRunner` does (what each trial size's steps do, step by step).

For every step: the allocator retries it made (flushes of its cache), its allocated and reserved
peaks and the inactive split bytes after it, in MiB, and the segments it asked the driver for.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/diag_fresh_layout.py --sizes 101,102
    python scripts/diag_fresh_layout.py --device cpu --quick --sizes 4        (proves it runs)
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from bench_promise import Capped, _trial_log, build, free_memory, make_state, plain_step, warm_up  # noqa: E402


def stepwise(step, batch_size: int, steps: int, device: str, limit: int) -> dict:
    """``steps`` calls of ``step(batch_size)`` under the cap, each one's allocator figures."""
    rows, error = [], None
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    with Capped(device, limit):
        for index in range(steps):
            if device == "cuda":
                stats = torch.cuda.memory_stats()
                before, mallocs = stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)
                torch.cuda.reset_peak_memory_stats()
            try:
                step(batch_size)
            except BaseException as exc:  # noqa: BLE001
                if not autobatch.is_oom_error(exc):
                    raise
                error = {"step": index, "error": " ".join(str(exc).split())[:400]}
                break
            if device == "cuda":
                stats = torch.cuda.memory_stats()
                rows.append((index, stats.get("num_alloc_retries", 0) - before, mib(stats["allocated_bytes.all.peak"]),
                             mib(stats["reserved_bytes.all.peak"]), mib(stats["inactive_split_bytes.all.current"]),
                             stats.get("num_device_alloc", 0) - mallocs))
            else:
                rows.append((index,))
    return {"batch": batch_size, "steps_run": len(rows), "oom": error, "per_step": rows}


def prime(what: str, model, optimizer, device: str, dtype) -> None:
    """Before the first step: ``cublas`` makes the matmul libraries' handles and workspaces (a
    tiny matmul in each precision), ``state`` the optimizer's state (one step on zero gradients),
    ``shapes_same``/``shapes_small`` (in ``child``) one forward and backward at the batch size or at 8,
    with no optimizer step, the gradients dropped and the cache emptied (the kernels' first uses at a
    shape, such as cuDNN's plans, made before the first step), ``ckpt_cpu``/``ckpt_cuda`` that state through a checkpoint (``torch.save``, the state dropped
    and the cache emptied, then ``torch.load(map_location=...)`` and ``load_state_dict`` for the
    model and the optimizer: a resumed run, loading to the host or to the device), ``none``
    nothing."""
    if what in ("cublas", "both"):
        x = torch.ones(16, 16, device=device)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            (x @ x).sum().item()
        (x @ x).sum().item()
    if what in ("state", "both"):
        make_state(model, optimizer)
    if what.startswith("ckpt_"):  # a checkpoint round trip: saved, the process emptied, loaded back
        make_state(model, optimizer)
        saved = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
        optimizer.state.clear()
        free_memory()
        saved.seek(0)
        checkpoint = torch.load(saved, map_location=what[len("ckpt_"):], weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        del checkpoint


def by_hand_trial(step, optimizer, size: int, steps: int, device: str, limit: int, clear: bool = False) -> dict:
    """One probe trial by hand: the cache returned first, ``steps`` steps, the leftovers of an
    out-of-memory step dropped after it (its gradients, its garbage). ``clear``: the cuBLAS
    workspaces freed first too, so the first step makes them among its activations, as a new
    process does."""
    if device == "cuda":
        if clear:
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    row = stepwise(step, size, steps, device, limit)
    if device == "cuda":  # each large request has a segment of its own: the largest bounds the largest request
        segments = [segment["total_size"] for segment in torch.cuda.memory_snapshot()]
        row["segments"] = len(segments)
        row["largest_segments_mib"] = [round(b / 2**20, 1) for b in sorted(segments)[-3:]]
    if row["oom"] is not None:
        optimizer.zero_grad()
        free_memory()
    return row


def pooled(step, model, optimizer, size: int, steps: int, device: str, limit: int, pool: bool = True,
           clear: bool = False) -> dict:
    """``steps`` steps at ``size`` with the state and gradients dropped first and (``pool``) every
    allocation routed to a new private pool, all dropped again after (the pool's segments returned).
    ``clear``: the cuBLAS workspaces freed first too, so the first step makes them again."""
    optimizer.state.clear()
    optimizer.zero_grad(set_to_none=True)
    if clear and device == "cuda":
        torch._C._cuda_clearCublasWorkspaces()
    free_memory()
    if device != "cuda" or not pool:
        row = stepwise(step, size, steps, device, limit)
        optimizer.state.clear()
        optimizer.zero_grad(set_to_none=True)
        free_memory()
        return row
    index, pool = torch.cuda.current_device(), torch.cuda.MemPool()
    torch._C._cuda_beginAllocateToPool(index, pool.id)
    try:
        row = stepwise(step, size, steps, device, limit)
    finally:
        torch._C._cuda_endAllocateToPool(index, pool.id)
        torch._C._cuda_releasePool(index, pool.id)
    optimizer.state.clear()
    optimizer.zero_grad(set_to_none=True)
    del pool
    free_memory()
    row["reserved_after_mib"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    return row


def child(args) -> dict:
    """One layout in this process: ``fresh`` at ``args.batch``, or a probe then ``probed``/``dropped``."""
    device, limit = args.device, autobatch.parse_bytes(args.memory_limit)
    if not args.cold:
        warm_up(args.workload, device, args.quick)
    model, optimizer, loss_fn, make, dtype, _ = build(args.workload, device, args.quick)
    prime(args.prime, model, optimizer, device, dtype)
    step = plain_step(model, optimizer, loss_fn, make, dtype, device)
    if args.prime.startswith("shapes_"):  # first uses at a shape (kernels' plans, handles), with no state made
        size = args.batch if args.prime == "shapes_same" else 8
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, make(size))
        loss.backward()
        del loss
        optimizer.zero_grad()
        free_memory()
    out: dict = {"layout": args.layout}
    if args.layout == "trials":
        trials = [(8, 3), (args.fit, 1)] + [(int(s), args.steps) for s in args.sizes.split(",")]
        # the first trial makes the workspaces, as the probe's first trial does
        out["sizes"] = [by_hand_trial(step, optimizer, size, steps, device, limit, args.clear_workspaces and index > 0)
                        for index, (size, steps) in enumerate(trials)]
        return out
    batch = args.batch
    if args.layout != "fresh":
        result = autobatch.find_max_batch(step, memory_limit=None if device == "cpu" else limit, device=device, cache=False)
        batch = result.batch_size + args.offset
        out["answer"], out["promise"] = result.batch_size, result.promise
        out["trials"] = _trial_log(result)  # bench_promise's columns (MiB), the flushes last
        if args.layout in ("pooled", "regrown"):
            out["pooled"] = [pooled(step, model, optimizer, batch + int(o), args.steps, device, limit, args.layout == "pooled",
                                    args.clear_workspaces)
                             for o in args.pool_offsets.split(",")]
            return out
        if args.layout == "dropped":
            optimizer.state.clear()  # the loop's first step makes it again, as in a new process
            free_memory()
    out.update(stepwise(step, batch, args.steps, device, limit))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="vit_b16")
    parser.add_argument("--sizes", default="101,102", help="sizes for the fresh layout")
    parser.add_argument("--layouts", default="fresh,probed,dropped")
    parser.add_argument("--clear-workspaces", action="store_true", help="trials, regrown, pooled: free the cuBLAS workspaces before each")
    parser.add_argument("--fit", type=int, default=134, help="trials: the second fit size")
    parser.add_argument("--offset", type=int, default=0, help="probed/dropped: train at the answer plus this")
    parser.add_argument("--pool-offsets", default="0,-1,-2,-3", help="pooled: sizes, as offsets from the answer")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--memory-limit", default=None, help="default 8GiB (16MiB on the CPU)")
    parser.add_argument("--cold", action="store_true", help="no warm-up in the child (a training script's own start)")
    parser.add_argument("--primes", default="none", help="fresh layout: none,cublas,state,both,ckpt_cpu,ckpt_cuda,shapes_same,shapes_small before the first step")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prime", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.memory_limit = args.memory_limit or ("16MiB" if args.device == "cpu" else "8GiB")
    if args.child:
        torch.backends.cudnn.benchmark = args.workload.endswith("_tuned")
        if args.device == "cpu":
            with autobatch.simulated_memory(args.memory_limit):
                return print(json.dumps(child(args), default=str))
        return print(json.dumps(child(args), default=str))
    rows = []
    for name in args.workloads.split(","):
        jobs = [("fresh", int(s), p) for s in args.sizes.split(",") for p in args.primes.split(",")
                if "fresh" in args.layouts.split(",")]
        jobs += [(layout, 0, "none") for layout in ("probed", "dropped", "trials", "pooled", "regrown") if layout in args.layouts.split(",")]
        for layout, size, primed in jobs:
            command = [sys.executable, __file__, "--child", "--workload", name, "--layout", layout, "--batch", str(size),
                       "--steps", str(args.steps), "--device", args.device, "--memory-limit", args.memory_limit,
                       "--offset", str(args.offset), "--prime", primed, "--sizes", args.sizes,
                       "--fit", str(args.fit), "--pool-offsets", args.pool_offsets] + (["--clear-workspaces"] if args.clear_workspaces else []) + (["--quick"] if args.quick else []) + (
                       ["--cold"] if args.cold else [])
            done = subprocess.run(command, capture_output=True, text=True)
            row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                "layout": layout, "error": done.stderr.strip().splitlines()[-3:]}
            row["workload"], row["prime"], row["cold"] = name, primed, args.cold
            rows.append(row)
            for trial in row.get("sizes", []):
                print("   trial", trial["batch"], "oom", trial["oom"] and trial["oom"]["step"],
                      "retries by step", [r[1] for r in trial["per_step"] if len(r) > 1],
                      "mallocs by step", [r[5] for r in trial["per_step"] if len(r) > 5], "last", trial["per_step"][-1:],
                      "largest segments", trial.get("largest_segments_mib"), flush=True)
            per = row.get("per_step", [])
            print(name, layout, row.get("batch"), "cold" if args.cold else "warm", "prime", primed, "answer", row.get("answer"), "oom", row.get("oom"),
                  "retries by step", [r[1] for r in per if len(r) > 1], flush=True)
            for trial in row.get("pooled", []):
                print("   pooled", trial["batch"], "oom", trial["oom"] and trial["oom"]["step"],
                      "retries by step", [r[1] for r in trial["per_step"] if len(r) > 1],
                      "reserved after", trial.get("reserved_after_mib"), flush=True)
            if "trials" in row:
                print("   trials", row["trials"], flush=True)
            print("   first steps", per[:6], "last", per[-2:], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
