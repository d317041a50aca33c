#!/usr/bin/env python
"""GPU benchmark: autobatch's strategies against Lightning's and Accelerate's batch finders.

For each model (a ResNet-50 CNN and a GPT-2 language model, AdamW, bf16 autocast) and each
method, a fresh process builds the model, runs the method under a memory cap, then runs 20
further training steps at the batch it found, in the same process. Reported: found batch,
its fraction of the exact maximum, trials, probe wall time, and whether the 20 steps ran.

The exact maximum is established by bisection with a fresh process per trial (3 training
steps each), bracketed first around autobatch's binary answer and widened if the fresh
processes disagree with it.

    python scripts/bench_probe.py --memory-limit 16GiB --out bench_probe.md
    python scripts/bench_probe.py --methods autobatch-auto accelerate --repeat 3   # timing spread
    python scripts/bench_probe.py --device cpu --models mlp   # a quick check without a GPU

Needs CUDA for the real run; Lightning and Accelerate where installed (skipped otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS_PER_TRIAL = 3
FOLLOW_ON_STEPS = 20
AUTOBATCH_METHODS = ["autobatch-auto", "autobatch-predict", "autobatch-binary", "autobatch-power", "autobatch-halving"]
PEER_METHODS = ["lightning-power", "lightning-binsearch", "accelerate"]


# --------------------------------------------------------------------------- models
def build(model_name: str, device: str):
    """(model, optimizer factory inputs, make_batch, loss_fn, autocast dtype)."""
    import torch

    torch.manual_seed(0)
    autocast = torch.bfloat16 if device == "cuda" else None
    if model_name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000)

        def make_batch(n):
            return (torch.randn(n, 3, 224, 224, device=device), torch.randint(0, 1000, (n,), device=device))

        def loss_fn(m, b):
            return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    elif model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
        model = GPT2LMHeadModel(config)
        seq = 1024

        def make_batch(n):
            return torch.randint(0, config.vocab_size, (n, seq), device=device)

        def loss_fn(m, b):
            return m(input_ids=b, labels=b).loss

    elif model_name == "mlp":  # a CPU smoke test
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))

        def make_batch(n):
            return (torch.randn(n, 256, device=device), torch.randint(0, 10, (n,), device=device))

        def loss_fn(m, b):
            return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    else:
        raise SystemExit(f"unknown model {model_name!r}; use resnet50, gpt2 or mlp")
    return model.to(device), make_batch, loss_fn, autocast


def set_cap(device: str, limit_bytes: int) -> None:
    import torch

    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(limit_bytes / torch.cuda.get_device_properties(0).total_memory)


# --------------------------------------------------------------------------- worker
def worker(args) -> dict:
    import torch

    import autobatch

    limit = autobatch.parse_bytes(args.memory_limit)
    model, make_batch, loss_fn, autocast = build(args.model, args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = autobatch.TrainStep(model, optimizer, loss_fn, make_batch, autocast_dtype=autocast)
    if args.device == "cuda":
        torch.cuda.synchronize()
    sizes: list[int] = []
    began = time.perf_counter()
    if args.method == "trial":  # one fresh-process trial for the exact maximum
        set_cap(args.device, limit)
        budget = autobatch.simulated_memory(limit) if args.device == "cpu" else contextlib.nullcontext()
        try:
            with budget:
                for _ in range(STEPS_PER_TRIAL):
                    step(args.batch)
            if args.device == "cuda":
                torch.cuda.synchronize()
            return {"passed": True}
        except torch.OutOfMemoryError:
            return {"passed": False}
    if args.method.startswith("autobatch-"):
        strategy = args.method.split("-", 1)[1]
        kwargs = {"start": args.guess} if strategy == "halving" else {}
        if args.device == "cpu":
            kwargs["memory_limit"] = limit
        else:
            set_cap(args.device, limit)  # same cap as the peers get
        result = autobatch.find_max_batch(
            step, strategy=strategy, steps_per_trial=STEPS_PER_TRIAL, max_batch=args.max_batch, cache=False, **kwargs
        )
        found = result.batch_size
        sizes = [t.batch_size for t in result.trials]
        extra = {
            "ooms": result.num_ooms,
            "fallback": result.fallback_reason,
            "trial_records": [
                {"batch": t.batch_size, "passed": t.passed, "purpose": t.purpose, "s": round(t.seconds, 4),
                 "peak": t.peak_bytes, "reserved": t.reserved_bytes, "steps": t.steps,
                 "step_peak": t.step_peak_bytes, "resident": t.resident_bytes}
                for t in result.trials
            ],
            "trial_s": sum(t.seconds for t in result.trials),
        }
    elif args.method.startswith("lightning-"):
        set_cap(args.device, limit)
        found, sizes = run_lightning(args, model, make_batch, loss_fn)
        model.to(args.device)  # Lightning's teardown leaves the module on the CPU
        extra = {}
    elif args.method == "accelerate":
        set_cap(args.device, limit)
        found, sizes = run_accelerate(args, step)
        extra = {"start": args.guess}
    else:
        raise SystemExit(f"unknown method {args.method}")
    probe_s = time.perf_counter() - began
    autobatch.free_memory()
    follow_ok, follow_error, done = True, None, 0
    try:
        for _ in range(FOLLOW_ON_STEPS):
            step(found)
            done += 1
        if args.device == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as exc:
        follow_ok, follow_error = False, f"after {done} steps: " + " ".join(str(exc).split())[:400]
    return {
        "model": args.model,
        "method": args.method,
        "found": found,
        "trials": len(sizes),
        "sizes": sizes,
        "probe_s": probe_s,
        "follow_on_ok": follow_ok,
        "follow_on_error": follow_error,
        **extra,
    }


def run_lightning(args, model, make_batch, loss_fn):
    import torch

    try:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        import pytorch_lightning as pl
        from pytorch_lightning.tuner import Tuner

    seen: list[int] = []

    class Wrapped(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.batch_size = 2

        def train_dataloader(self):
            indices = torch.utils.data.TensorDataset(torch.arange(self.batch_size * 64))
            return torch.utils.data.DataLoader(indices, batch_size=self.batch_size)

        def training_step(self, batch, _):
            n = len(batch[0])
            if not seen or seen[-1] != n:
                seen.append(n)
            return loss_fn(self.model, make_batch(n))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    module = Wrapped()
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if args.device == "cuda" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
    )
    mode = args.method.split("-", 1)[1]
    found = Tuner(trainer).scale_batch_size(
        module, mode=mode, steps_per_trial=STEPS_PER_TRIAL, init_val=2, max_trials=25, batch_arg_name="batch_size"
    )
    return int(found), seen


def run_accelerate(args, step):
    from accelerate.utils import find_executable_batch_size

    sizes: list[int] = []

    @find_executable_batch_size(starting_batch_size=args.guess)
    def inner(batch_size):
        sizes.append(batch_size)
        for _ in range(STEPS_PER_TRIAL):
            step(batch_size)
        return batch_size

    return inner(), sizes


# --------------------------------------------------------------------------- orchestrator
def spawn(args, method: str, **extra) -> dict:
    command = [sys.executable, __file__, "worker", "--model", args.model_name, "--method", method,
               "--device", args.device, "--memory-limit", args.memory_limit]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"model": args.model_name, "method": method, "error": (proc.stderr or proc.stdout)[-600:]}


def exact_maximum(args, near: int) -> tuple[int, int]:
    """Bisect with a fresh process per trial, starting from the bracket [near, near + 1]."""
    tried = 0

    def fits(batch: int) -> bool:
        nonlocal tried
        tried += 1
        return bool(spawn(args, "trial", batch=batch).get("passed"))

    lo, hi = near, near + 1
    while not fits(lo):  # widen downwards
        hi, lo = lo, max(1, lo - max(1, lo // 16))
    step = 1
    while fits(hi):  # widen upwards
        lo, hi, step = hi, hi + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def orchestrate(args) -> None:
    rows = []
    for model_name in args.models:
        args.model_name = model_name
        binary = spawn(args, "autobatch-binary")
        if "found" not in binary:
            print(f"{model_name}: binary failed: {binary.get('error')}", file=sys.stderr)
            continue
        exact, exact_trials = exact_maximum(args, binary["found"])
        guess = 2 ** math.ceil(math.log2(exact + 1))  # a generous power-of-two guess above the maximum
        print(f"{model_name}: exact maximum {exact} ({exact_trials} fresh-process trials); guess {guess}", flush=True)
        for method in args.methods:
            runs = [binary] if method == "autobatch-binary" else []
            while len(runs) < args.repeat:
                runs.append(spawn(args, method, guess=guess))
            for repeat, r in enumerate(runs):
                r["exact"], r["repeat"] = exact, repeat
                rows.append(r)
                print(json.dumps(r), flush=True)
    write_table(rows, args)


def write_table(rows, args) -> None:
    lines = [
        f"| model | method | found | of exact max | trials | probe time (s) | {FOLLOW_ON_STEPS} more steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "found" not in r:
            lines.append(f"| {r['model']} | {r['method']} | error | | | | {r.get('error', '')[-80:]!r} |")
            continue
        share = f"{100 * r['found'] / r['exact']:.1f} %"
        follow = "ok" if r["follow_on_ok"] else f"OOM"
        lines.append(
            f"| {r['model']} (max {r['exact']}) | {r['method']} | {r['found']} | {share} | {r['trials']} | "
            f"{r['probe_s']:.1f} | {follow} |"
        )
    times: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if "found" in r:
            times.setdefault((r["model"], r["method"]), []).append(r["probe_s"])
    if any(len(t) > 1 for t in times.values()):
        lines += ["", "| model | method | runs | median probe time (s) | range (s) |", "| --- | --- | ---: | ---: | --- |"]
        for (model, method), values in times.items():
            values.sort()
            lines.append(f"| {model} | {method} | {len(values)} | {values[len(values) // 2]:.2f} | "
                         f"{values[0]:.2f} - {values[-1]:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
        Path(args.out).with_suffix(".jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    parser.add_argument("--models", nargs="+", default=["resnet50", "gpt2"])
    parser.add_argument("--methods", nargs="+", default=AUTOBATCH_METHODS + PEER_METHODS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--memory-limit", default="16GiB")
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=1, help="fresh-process runs of each method (median time reported)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model")
    parser.add_argument("--method")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--guess", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="worker: print a cProfile summary to stderr")
    args = parser.parse_args()
    if args.mode == "worker":
        import logging

        logging.basicConfig(level=logging.WARNING)
        if args.profile:  # where the probe's time goes: the 30 costliest calls, to stderr
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            outcome = profiler.runcall(worker, args)
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
        else:
            outcome = worker(args)
        print("RESULT " + json.dumps(outcome), flush=True)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
