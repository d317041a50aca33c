"""Benchmark autobatch.Runner: OOM recovery on a real model, and its overhead with no OOM.

Part 1, recovery: a small GPT (``scripts/bench_plan.py``'s) starts with the micro-batch equal
to the global batch, far above what fits under a memory cap (CUDA: a per-process cap;
CPU: a simulated budget). The runner must halve its way down and finish every step.

Part 2, overhead: with no cap and a micro-batch that fits, global-step times of a
plain accumulation loop (zero_grad, forward/backward per micro-batch with the loss weighted
n / global, optimizer step, ``loss.item()``) against the runner with each step guard
(``auto``, the default; ``cpu``; ``device``; ``off``) and with ``empty_cache`` after every step
(the cache-hygiene cost). Every variant runs once per round, in a shuffled order; the
overhead is the median over rounds of (variant's median step / plain loop's median step in
that round) - 1, so drift of the device's clocks cancels.
Every step is synchronised before its clock is read.

Part 3, guard check: the same steps from the same state with an OOM injected before the
optimizer step and with one raised *after* a real optimizer step (a step post-hook) must
end with the same weights (the guard undid the applied update).

    python scripts/bench_runner.py --device cuda            # GPT-2-ish, capped at 6 GiB for part 1
    python scripts/bench_runner.py --device cpu             # a tiny model; checks the script runs

Prints markdown tables and the overhead; exit status 1 if part 1 or part 3 fails, or (on a
GPU) the default runner is more than 1 % slower than the plain loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import autobatch  # noqa: E402
from autobatch.planning.accumulation import split_batch  # noqa: E402
from autobatch.memory.devices import AcceleratorMemory, resolve_device  # noqa: E402
from autobatch.memory.units import parse_bytes  # noqa: E402
from bench_plan import GPT, lm_loss  # noqa: E402

DEFAULTS = {
    "cuda": dict(layers=8, d_model=512, heads=8, seq_len=1024, vocab=16384, global_batch=64, memory_limit="6GiB",
                 micro_batch=8, steps=30, warmup=5, rounds=5),
    "cpu": dict(layers=2, d_model=32, heads=2, seq_len=32, vocab=128, global_batch=16, memory_limit="3MiB",
                micro_batch=4, steps=10, warmup=3, rounds=2),
}
OVERHEAD_LIMIT = 0.01


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name in ("layers", "d_model", "heads", "seq_len", "vocab", "global_batch", "micro_batch", "steps", "warmup", "rounds"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--memory-limit", default=None, help="part 1 cap, e.g. 6GiB")
    parser.add_argument("--recovery-steps", type=int, default=10)
    parser.add_argument("--json", default=None, help="write all figures to this file")
    args = parser.parse_args()
    for key, value in DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build(args, device, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(args.vocab, args.seq_len, args.d_model, args.heads, args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, optimizer


def make_batches(args, device, count: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1), generator=generator).to(device)
            for _ in range(count)]


def cycle(batches, steps):
    return [batches[i % len(batches)] for i in range(steps)]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- part 1 -----------------------------------------------------------------------------------
def part_recovery(args, device) -> dict:
    model, optimizer = build(args, device)
    batches = make_batches(args, device)
    limit = parse_bytes(args.memory_limit)
    cap = AcceleratorMemory(device).capped(limit) if device.type == "cuda" else autobatch.simulated_memory(limit)
    began = time.perf_counter()
    error = None
    with cap:
        runner = autobatch.Runner(model, optimizer, lm_loss, global_batch=args.global_batch,
                                  micro_batch=args.global_batch, progress=False, grow_after=None)
        try:
            result = runner.fit(cycle(batches, args.recovery_steps))
        except Exception as exc:  # noqa: BLE001 - reported, then the script fails
            error, result = f"{type(exc).__name__}: {exc}", runner.result
    figures = {
        "finished": error is None and result.steps == args.recovery_steps,
        "steps": result.steps,
        "start_micro_batch": args.global_batch,
        "final_micro_batch": runner.micro_batch,
        "recoveries": [(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"]) for r in result.oom_recoveries],
        "memory_limit": args.memory_limit,
        "seconds": time.perf_counter() - began,
        "error": error,
    }
    del runner, model, optimizer
    autobatch.free_memory()
    return figures


# -- part 2 -----------------------------------------------------------------------------------
def plain_loop(model, optimizer, batches, micro, device) -> list[float]:
    times = []
    for batch in batches:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for piece in split_batch(batch, micro, balanced=True):
            loss = lm_loss(model, piece)
            (loss * (piece.shape[0] / batch.shape[0])).backward()
            total += loss.detach() * piece.shape[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(total.item())
        sync(device)
        times.append(time.perf_counter() - began)
    return times


def runner_loop(model, optimizer, batches, micro, device, **options) -> list[float]:
    times = []
    clock = [0.0]

    def on_step_end(info):
        sync(device)
        now = time.perf_counter()
        times.append(now - clock[0])
        clock[0] = now

    runner = autobatch.Runner(model, optimizer, lm_loss, global_batch=batches[0].shape[0], micro_batch=micro,
                              progress=False, grow_after=None, **options)
    sync(device)
    clock[0] = time.perf_counter()
    runner.fit(batches, on_step_end=on_step_end)
    return times


VARIANTS = {
    "plain loop": None,
    "runner (step_guard=auto, default)": {"step_guard": "auto"},
    "runner (step_guard=cpu)": {"step_guard": "cpu"},
    "runner (step_guard=device)": {"step_guard": "device"},
    "runner (step_guard=off)": {"step_guard": "off"},
    "runner + empty_cache every step": {"step_guard": "cpu", "empty_cache_every": 1},
}


def part_overhead(args, device, micro: int) -> dict:
    """Every variant once per round, in a shuffled order (seeded), so neither drift nor a
    fixed neighbour (the variant that empties the cache) favours one. A variant's overhead is
    the median over rounds of its median step / the plain loop's median step *in the same
    round*: paired by round, slow drift of the device's clocks cancels."""
    import random

    model, optimizer = build(args, device)
    batches = make_batches(args, device)
    samples = {name: [] for name in VARIANTS}
    per_round = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    shuffler = random.Random(0)
    for round_ in range(args.rounds):
        shuffler.shuffle(order)
        for name in order:
            options = VARIANTS[name]
            run = cycle(batches, args.warmup + args.steps)
            if options is None:
                times = plain_loop(model, optimizer, run, micro, device)
            else:
                times = runner_loop(model, optimizer, run, micro, device, **options)
            samples[name].extend(times[args.warmup :])
            per_round[name].append(statistics.median(times[args.warmup :]))
    rows = {}
    for name, times in samples.items():
        ratios = [mine / plain - 1 for mine, plain in zip(per_round[name], per_round["plain loop"])]
        rows[name] = {
            "median_s": statistics.median(times),
            "overhead": statistics.median(ratios),
            "overhead_range": [min(ratios), max(ratios)],
            "steps_timed": len(times),
        }
    return {"micro_batch": micro, "global_batch": args.global_batch, "rows": rows}


# -- part 3 -----------------------------------------------------------------------------------
class _RaiseAfterStep:
    def __init__(self, call: int) -> None:
        self.call, self.calls = call, 0

    def __call__(self, *args) -> None:
        self.calls += 1
        if self.calls == self.call:
            raise torch.OutOfMemoryError("CUDA out of memory (bench: after a real optimizer step)")


def part_guard(args, device, micro: int) -> dict:
    batches = cycle(make_batches(args, device), 6)
    finals = {}
    for name in ("before the step (injected)", "after a real step (post-hook)"):
        model, optimizer = build(args, device, seed=3)
        runner = autobatch.Runner(model, optimizer, lm_loss, global_batch=args.global_batch, micro_batch=micro,
                                  progress=False, grow_after=None)
        if name.startswith("before"):
            autobatch.inject_oom(runner, (3, "optimizer"))
        else:
            optimizer.register_step_post_hook(_RaiseAfterStep(4))
        result = runner.fit(batches)
        assert [r["phase"] for r in result.oom_recoveries] == ["optimizer"]
        finals[name] = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        del runner, model, optimizer
    a, b = finals.values()
    relative = float((a - b).abs().max() / a.abs().max())
    return {"max_relative_difference": relative, "ok": relative < 1e-4}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args()
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# Runner benchmark on {name} (torch {torch.__version__})\n")
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, vocab {args.vocab}, "
          f"global batch {args.global_batch}, AdamW\n")

    recovery = part_recovery(args, device)
    print("## Part 1: start far above the maximum\n")
    print("| memory cap | start micro-batch | final micro-batch | steps | recoveries (step, phase, from, to) | finished |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    print(f"| {recovery['memory_limit']} | {recovery['start_micro_batch']} | {recovery['final_micro_batch']} | "
          f"{recovery['steps']} | {recovery['recoveries']} | {'yes' if recovery['finished'] else 'NO: ' + str(recovery['error'])} |\n")

    micro = args.micro_batch
    overhead = part_overhead(args, device, micro)
    print(f"## Part 2: overhead with no OOM (micro-batch {micro}, {args.rounds} rounds in shuffled order, "
          f"{args.steps} timed steps after {args.warmup} warm-up steps per variant and round)\n")
    print("| variant | median step (ms) | vs plain loop (median over rounds) | range over rounds |")
    print("| --- | ---: | ---: | ---: |")
    for variant, row in overhead["rows"].items():
        low, high = row["overhead_range"]
        print(f"| {variant} | {row['median_s'] * 1e3:.2f} | {row['overhead'] * 100:+.2f} % | "
              f"{low * 100:+.2f} … {high * 100:+.2f} % |")
    default = overhead["rows"]["runner (step_guard=auto, default)"]["overhead"]
    within = default <= OVERHEAD_LIMIT or device.type == "cpu"
    verdict = ("not judged on the CPU (a check that the script runs)" if device.type == "cpu"
               else "PASS" if within else "FAIL")
    print(f"\ndefault runner overhead {default * 100:+.2f} % (limit {OVERHEAD_LIMIT * 100:.0f} %): {verdict}\n")

    guard = part_guard(args, device, micro)
    print("## Part 3: OOM before vs after a real optimizer step (step guard)\n")
    print(f"max relative weight difference {guard['max_relative_difference']:.2e}: {'PASS' if guard['ok'] else 'FAIL'}")

    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": name, "args": vars(args), "recovery": recovery, "overhead": overhead, "guard": guard},
                      handle, indent=2, default=str)
    return 0 if recovery["finished"] and within and guard["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
