"""Where does a probe's wall time go? (issue 16, diagnostics)

Each (workload, form) runs in its own fresh process after bench_promise's warm-up, under
cProfile: the probe's total, the sum of its trials' own seconds, and the functions with the
largest cumulative time (autobatch's and torch's allocator / cuDNN calls), so the time
outside the trials (cleanup after OOM trials, the snapshot, the restore) is visible.

    python scripts/diag_probe_time.py --workloads resnet50,vit_b16,gpt2 --forms trainstep,plain
    python scripts/diag_probe_time.py --phases ...    (no profiler: the seconds of each of PHASES,
        synchronised; on an H200 the zero-lr check, steps_in_place_at_zero_lr, took 0.105-0.109 s)
    python scripts/diag_probe_time.py --step-times --forms trainstep,plain,accelerate --start 256
        (no profiler: each call of the step, synchronised, with Accelerate's from --start;
        --no-guard probes without the peak guard, --gc-log logs the collector's runs, --no-gc
        probes with automatic collection off: on an H200 ResNet-50's probe ran 6 young
        collections and no older one, so collection was not where its time varied)
    python scripts/diag_probe_time.py --device cpu --quick          (seconds; proves it runs)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from bench_promise import build, plain_step, warm_up  # noqa: E402


def one(args) -> dict:
    """The probe of one (workload, form), profiled, in this process."""
    name, form, device = args.child, args.form, args.device
    torch.backends.cudnn.benchmark = name.endswith("_tuned")
    cap = None if device == "cpu" else args.memory_limit
    warm_up(name, device, args.quick)
    model, optimizer, loss_fn, make, dtype, _ = build(name, device, args.quick)
    fn = (autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype) if form == "trainstep"
          else plain_step(model, optimizer, loss_fn, make, dtype, device))
    phases = _time_phases() if args.phases else {}
    if args.no_guard:  # the same probe without the peak guard (what the guard's hooks cost a step)
        import autobatch.probe.find as find_module
        find_module.peak_guard_for = lambda *a, **k: None
    calls: list = []
    if args.step_times:
        fn = _timed_calls(fn, calls, device, args.signatures)
    if form == "accelerate":
        return _accelerate(args, name, fn, cap, calls)
    collections = _log_collections() if args.gc_log else []
    if args.no_gc:
        import gc
        gc.disable()
    profiler = cProfile.Profile()
    began = time.perf_counter()
    if not (args.phases or args.step_times):
        profiler.enable()
    result = autobatch.find_max_batch(fn, memory_limit=cap, device=device, cache=False)
    profiler.disable()
    total = time.perf_counter() - began
    text = io.StringIO()
    if not (args.phases or args.step_times):
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return {"workload": name, "form": form, "batch": result.batch_size, "total_s": round(total, 3),
            "trials_s": round(sum(t.seconds for t in result.trials), 3),
            "trials": [(t.batch_size, t.passed, t.steps, t.purpose, round(t.seconds, 3)) for t in result.trials],
            "records": [t.to_dict() for t in result.trials], "fit": result.fit,
            "capacity": getattr(result, "capacity_bytes", None), "notes": list(result.notes),
            "profile": lines[start:], "phases": {name: round(t, 4) for name, t in phases.items()},
            "calls": calls, "collections": [(g, round(t, 4), round(d, 4)) for g, t, d in collections]}


def _log_collections() -> list:
    """The garbage collector's runs from now on: (generation, seconds since now, seconds it took)."""
    import gc

    log: list = []
    began, starts = time.perf_counter(), {}

    def callback(phase, info):
        if phase == "start":
            starts["t"] = time.perf_counter()
        else:
            log.append((info["generation"], starts["t"] - began, time.perf_counter() - starts["t"]))

    gc.callbacks.append(callback)
    return log


def _layout_signature() -> int:
    """A hash of the caching allocator's layout: each segment's kind, stream and size, in address
    order, with its blocks' sizes and states (no addresses): equal layouts serve the same requests
    the same way."""
    segments = sorted(torch.cuda.memory_snapshot(), key=lambda s: s["address"])
    return hash(tuple((s["segment_type"], s["stream"], s["total_size"],
                       tuple((b["size"], b["state"]) for b in s["blocks"])) for s in segments))


def _timed_calls(fn, calls: list, device: str, signatures: bool = False):
    """``fn`` with each call's (batch, seconds from the probe's start, seconds, outcome, allocator
    flushes during it, then its allocated, reserved and inactive-split peaks in MiB) appended to ``calls``, synchronised on CUDA: where inside each trial the time goes (--step-times).
    A ``TrainStep`` stays one (its peak guard and zero-lr steps apply), its call timed."""
    began = time.perf_counter()

    def retries():
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0

    def timed(call, batch_size):
        if device == "cuda":
            torch.cuda.synchronize()
        before = retries()
        start, outcome = time.perf_counter(), "ok"
        try:
            return call(batch_size)
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            if device == "cuda" and outcome == "ok":
                torch.cuda.synchronize()
            calls.append((batch_size, round(start - began, 4), round(time.perf_counter() - start, 4), outcome,
                          retries() - before) + _peaks(device)
                         + ((_layout_signature() % 10**6,) if signatures and device == "cuda" else ()))

    if isinstance(fn, autobatch.TrainStep):
        base = type(fn)
        def call(self, batch_size):
            return timed(lambda n: base.__call__(self, n), batch_size)

        fn.__class__ = type("TimedTrainStep", (base,), {"__call__": call})
        return fn
    return lambda batch_size: timed(fn, batch_size)


def _peaks(device: str) -> tuple:
    """The call's peaks in MiB since the trial's reset (each trial step resets them): allocated,
    reserved, and the bytes in free pieces of partly used segments (inactive split), the
    fragmentation the allocator cannot return to serve a request; () off CUDA."""
    if device != "cuda":
        return ()
    stats = torch.cuda.memory_stats()
    return tuple(round(stats.get(f"{key}.all.peak", 0) / 2**20, 1)
                 for key in ("allocated_bytes", "reserved_bytes", "inactive_split_bytes"))


def _accelerate(args, name, fn, cap, calls) -> dict:
    """Accelerate's decorator on the same (timed) step, from the benchmark's start size."""
    from bench_promise import accelerate_probe

    out = accelerate_probe(fn, args.start, args.device, autobatch.parse_bytes(args.memory_limit))
    return {"workload": name, "form": "accelerate", "batch": out.get("batch_size"),
            "total_s": round(out.get("seconds", float("nan")), 3), "trials_s": None, "trials": [], "calls": calls,
            "profile": [], "phases": {}}


#: what a probe does outside its trials' own seconds, timed without a profiler's overhead (--phases)
PHASES = ("autobatch.probe.snapshot.restore:Snapshot.take", "autobatch.probe.snapshot.restore:Snapshot.restore",
          "autobatch.probe.snapshot.restore:steps_in_place_at_zero_lr", "autobatch.probe.find:release_after_probe",
          "autobatch.probe.trial:TrialRunner._clean_up_after_oom",
          "autobatch.probe.find:promise_note", "autobatch.probe.find:memory_diagnostics",
          "autobatch.probe.find:_finish", "autobatch.probe.trial:TrialRunner.run",
          "autobatch.probe.trial:TrialRunner._attempt", "autobatch.probe.trial:TrialRunner._garbage_was_in_the_way",
          "autobatch.probe.find:relayout_created_state", "autobatch.probe.find:park_created_state",
          "autobatch.memory.devices:AcceleratorMemory.release_cached", "autobatch.probe.trial:release_workspaces",
          "autobatch.probe.trial:free_memory", "autobatch.probe.fresh_layout:FreshLayout.__call__",
          "autobatch.probe.fresh_layout:FreshLayout.needed", "autobatch.probe.trial:split_bytes",
          "autobatch.memory.devices:AcceleratorMemory.largest_segment")


def _time_phases() -> dict:
    """Wrap each of ``PHASES`` so its calls add their seconds (synchronised on CUDA) to a total."""
    import functools
    import importlib

    totals: dict = {}
    for spec in PHASES:
        module_name, path = spec.split(":")
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        is_class = isinstance(original, classmethod)
        inner = original.__func__ if is_class else original

        def timed(*a, _inner=inner, _name=path, **k):
            began = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                totals[_name] = totals.get(_name, 0.0) + time.perf_counter() - began

        wrapped = functools.wraps(inner)(timed)
        setattr(owner, attr, classmethod(wrapped) if is_class else wrapped)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="resnet50,vit_b16,gpt2")
    parser.add_argument("--forms", default="trainstep,plain")
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--phases", action="store_true", help="time the phases outside the trials, no profiler")
    parser.add_argument("--step-times", action="store_true",
                        help="no profiler: each call of the step, synchronised (forms may include accelerate)")
    parser.add_argument("--gc-log", action="store_true", help="log the garbage collector's runs during the probe")
    parser.add_argument("--no-gc", action="store_true", help="probe with automatic garbage collection off")
    parser.add_argument("--signatures", action="store_true",
                        help="with --step-times: a hash of the allocator's layout after each call (segments, blocks)")
    parser.add_argument("--no-guard", action="store_true", help="probe without the peak guard")
    parser.add_argument("--start", type=int, default=256, help="Accelerate's starting batch size")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--form", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.device == "cpu":
            with autobatch.simulated_memory("16MiB"):
                return print(json.dumps(one(args)))
        return print(json.dumps(one(args)))
    rows = []
    forms = args.forms.split(",")
    for name, form in [(n, f) for r in range(args.rounds) for n in args.workloads.split(",")
                       for f in forms[r % len(forms):] + forms[:r % len(forms)]]:  # order rotated per round
        command = [sys.executable, __file__, "--child", name, "--form", form, "--device", args.device,
                   "--memory-limit", args.memory_limit, "--top", str(args.top), *(["--quick"] if args.quick else []),
                   *(["--phases"] if args.phases else []), *(["--step-times"] if args.step_times else []),
                   *(["--signatures"] if args.signatures else []),
                   "--start", str(args.start), *(["--no-guard"] if args.no_guard else []),
                   *(["--gc-log"] if args.gc_log else []), *(["--no-gc"] if args.no_gc else [])]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            rows.append({"workload": name, "form": form, "error": done.stderr.strip().splitlines()[-3:]})
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"== {name} {form}: batch {row['batch']} total {row['total_s']} s, in trials {row['trials_s']} s; {row['trials']}")
        if args.phases:
            print("   phases:", row["phases"], flush=True)
        elif args.step_times:
            print("   calls:", row["calls"], flush=True)
        else:
            print("\n".join(row["profile"][: args.top + 1]), flush=True)
        if args.gc_log:
            print("   collections (generation, at, took):", [c for c in row["collections"] if c[0] > 0 or c[2] > 0.005],
                  "gen0:", sum(1 for c in row["collections"] if c[0] == 0), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
