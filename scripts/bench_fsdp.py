"""FSDP2 benchmark: probe answer, agreement across ranks with different caps, runner overhead
against a hand-written FSDP2 loop, and a real one-rank OOM recovered.

GPU (lead, 2 x H200, < 8 min):
    torchrun --nproc-per-node 2 scripts/bench_fsdp.py --out fsdp_bench.json
CPU check (seconds, gloo, simulated memory):
    torchrun --nproc-per-node 2 scripts/bench_fsdp.py --device cpu --quick

The decoder is autobatch's built-in GPT (``--layers``/``--width``; default ~300M parameters at
sequence ``--seq`` 2048, bf16 autocast on CUDA), each block and the root ``fully_shard`` -ed,
AdamW. Caps: ``--caps`` GiB per rank (``set_per_process_memory_fraction`` on CUDA; a
simulated budget in MiB on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autobatch import Runner, TrainStep, find_max_batch  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from autobatch.dist.fsdp import shard_model  # noqa: E402
from autobatch.workloads.models import GPT  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few steps (CPU check)")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--caps", default="40,30", help="per-rank caps: GiB on CUDA, MiB on the CPU")
    parser.add_argument("--steps", type=int, default=30, help="timed steps for runner vs hand loop")
    parser.add_argument("--train-steps", type=int, default=200, help="train at the answer until this many steps in all")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.seq, args.vocab, args.steps, args.train_steps = 2, 32, 32, 64, 4, 8
        args.caps = "12,8" if args.device == "cpu" else args.caps
    return args


def build(args, device):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, layers=args.layers, width=args.width, heads=max(1, args.width // 64)).to(device)
    shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def cap(args, rank, device):
    """This rank's cap: a memory_limit for the probe (None on CUDA, where the process is capped)."""
    value = float(args.caps.split(",")[rank % len(args.caps.split(","))])
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, value * 2**30 / total), device)
        return None
    return f"{value}MiB"


def timed(fn, steps, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - began) / steps


def _count_votes(module=None, name: str = "exchange") -> dict:
    """Count calls of ``module.name`` and the host time spent in them; ``clear()`` resets. The
    default, ``autobatch.dist.agreement.exchange``, is the collective sync points; FSDP's votes go
    through ``autobatch.dist.fsdp_guard.exchange_via_store`` (``scripts/diag_fsdp_step.py`` counts those)."""
    if module is None:
        from autobatch.dist import agreement as module

    counts = {"count": 0, "seconds": 0.0}
    inner = getattr(module, name)

    def timed_exchange(values, label):
        began = time.perf_counter()
        try:
            return inner(values, label)
        finally:
            counts["count"] += 1
            counts["seconds"] += time.perf_counter() - began

    setattr(module, name, timed_exchange)
    counts["clear"] = lambda: counts.update(count=0, seconds=0.0)
    return counts


def main() -> None:
    args = parse()
    dist_sync.init_from_env(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    autocast = torch.bfloat16 if device.type == "cuda" else None
    limit = cap(args, rank, device)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)", "world": world}
    model, optimizer = build(args, device)
    report["parameters"] = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(rank)

    def make_batch(size):
        return torch.randint(0, args.vocab, (size, args.seq), generator=generator).to(device)

    # 1. the probe under different caps per rank: one agreed answer
    began = time.perf_counter()
    result = find_max_batch(TrainStep(model, optimizer, loss_fn, make_batch, autocast_dtype=autocast), memory_limit=limit,
                            strategy="binary", max_batch=1024, cache=False, steps_per_trial=2)
    report["probe"] = {"batch_size": result.batch_size, "trials": len(result.trials), "seconds": round(time.perf_counter() - began, 2),
                       "cap": args.caps.split(",")[rank % len(args.caps.split(","))], "notes": result.notes}
    answers = dist_sync.exchange([result.batch_size], "bench: answers")
    report["agreed"] = len({row[0] for row in answers}) == 1
    micro = max(1, result.batch_size)

    # 2. runner vs a hand FSDP2 loop at the answer
    data = [make_batch(micro).cpu() for _ in range(args.steps)]
    def hand(batches):
        for tokens in batches:
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model, tokens.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()

    hand(data[:2])  # warm-up
    votes = _count_votes()
    runners = {guard: Runner(model, optimizer, loss_fn, global_batch=micro * world, micro_batch=micro, device=device,
                             autocast_dtype=autocast, progress=False, log_every=None, grow_after=0, step_guard=guard)
               for guard in ("auto", "off")}
    for each in runners.values():  # warm-up: the first steps allocate the guard's buffers
        each.fit(data[:3], epochs=1)
    votes["clear"]()
    def run(guard):  # args.steps more steps (``steps`` counts over the whole run)
        runners[guard].fit(data, steps=runners[guard].step + args.steps)

    runner_s = timed(lambda: run("auto"), args.steps, device)
    report["votes_per_step"] = {"count": votes["count"] / args.steps, "seconds": round(votes["seconds"] / args.steps, 5)}
    unguarded_s = timed(lambda: run("off"), args.steps, device)
    hand_s = timed(lambda: hand(data), args.steps, device)
    report["step_seconds"] = {"runner": round(runner_s, 4), "runner_guard_off": round(unguarded_s, 4), "hand": round(hand_s, 4),
                              "overhead": round(runner_s / hand_s - 1, 4), "guard": runners["auto"].guard.placement}
    runner = runners["auto"]
    if args.train_steps > runner.step:  # the answer holds: this many steps at it, no OOM
        began = time.perf_counter()
        done = runner.fit(data, steps=args.train_steps)
        report["trained_at_answer"] = {"steps": done.steps, "micro_batch": runner.micro_batch, "recoveries": len(done.oom_recoveries),
                                       "seconds": round(time.perf_counter() - began, 1)}

    # 3. a real OOM on one rank: rank 0 uncapped, the others keep their cap, at twice the answer
    big = micro * 2
    if rank == 0:
        limit = None
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    data = [make_batch(big).cpu() for _ in range(3)]
    runner = Runner(model, optimizer, loss_fn, global_batch=big * world, micro_batch=big, device=device,
                    autocast_dtype=autocast, progress=False, log_every=None, grow_after=0)
    from autobatch import simulated_memory
    from contextlib import nullcontext

    with simulated_memory(limit) if limit else nullcontext():
        done = runner.fit(data, epochs=1)
    report["one_rank_oom"] = {"recoveries": done.oom_recoveries, "micro_batch": runner.micro_batch, "steps": done.steps}
    print(json.dumps({"rank": rank, **report}, default=str), flush=True)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
