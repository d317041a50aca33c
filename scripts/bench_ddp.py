"""Runner vs a hand-written DDP loop, same DDP model, same batches, 2 ranks (issue 17).

    torchrun --nproc_per_node=2 scripts/bench_ddp.py            # 2 GPUs, NCCL, bf16
    torchrun --nproc_per_node=2 scripts/bench_ddp.py --quick    # CPU, gloo, tiny models, seconds

The hand loop: ``zero_grad``; every micro-batch but the last under ``model.no_sync()``;
forward, ``(loss * n / share).backward()``; ``optimizer.step()``. The runner:
``autobatch.Runner`` on an identical DDP model (its own copy: one module cannot sit in two
DDP wrappers) with the same global batch and micro-batch, OOM recovery on (step guard "cpu").
Rounds alternate which one goes first; each round times ``--steps`` steps after
``--warmup`` (a device sync before and after); the median over rounds is reported. Models:
ResNet-50 (global batch 1024, micro-batch 128 per rank) and a GPT-2-small-like decoder
(12 x 768, 12 heads, sequence 1024, vocabulary 50257; global 64, micro 8). Rank 0 prints a
table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autobatch import Runner  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.ln(self.blocks(x)))


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10))


def workloads(quick: bool):
    """name -> (build model, make a (inputs, targets) batch of n samples, loss, global, micro)."""
    def ce(model, batch):
        out = model(batch[0])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[1].reshape(-1))

    if quick:
        return {
            "cnn": (small_cnn, lambda n, d: (torch.randn(n, 3, 16, 16, device=d), torch.randint(0, 10, (n,), device=d)), ce, 32, 4),
            "gpt": (lambda: GPT(128, 32, 32, 2, 2), lambda n, d: (torch.randint(0, 128, (n, 32), device=d),) * 2, ce, 16, 2),
        }
    import torchvision

    return {
        "resnet50": (lambda: torchvision.models.resnet50(), lambda n, d: (torch.randn(n, 3, 224, 224, device=d), torch.randint(0, 1000, (n,), device=d)), ce, 1024, 128),
        "gpt2_small": (lambda: GPT(50257, 1024, 768, 12, 12), lambda n, d: (torch.randint(0, 50257, (n, 1024), device=d),) * 2, ce, 64, 8),
    }


def hand_step(model, optimizer, loss_fn, batch, micro, autocast):
    share = batch[0].shape[0]
    optimizer.zero_grad(set_to_none=True)
    chunks = list(zip(*(t.split(micro) for t in batch)))
    for i, chunk in enumerate(chunks):
        context = model.no_sync() if i < len(chunks) - 1 else torch.enable_grad()
        with context:
            with autocast():
                loss = loss_fn(model, chunk)
            (loss * (chunk[0].shape[0] / share)).backward()
    optimizer.step()


def _busy_ms(events) -> tuple[float, float, float]:
    """(window, union of device-kernel and memcpy intervals, copies' share) in ms: how much of
    the profiled window the GPU worked, from the profiler's device events."""
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), "memcpy" in e.name().lower() or "copy" in e.name().lower())
                   for e in events if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    if not spans:
        return 0.0, 0.0, 0.0
    busy, end, copies = 0, spans[0][0], 0
    for start, stop, copy in spans:
        copies += (stop - start) if copy else 0
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return (spans[-1][1] - spans[0][0]) / 1e6, busy / 1e6, copies / 1e6


def profile(args, name: str, kinds: list, timed, rank: int) -> None:
    """Profile 2 steps of each kind; rank 0 writes ``summary_<model>.txt`` under ``--profile``
    (GPU busy time over the window, top operators by host time and by device time) and, with
    ``--traces``, gzipped chrome traces."""
    import gzip
    import shutil

    folder = Path(args.profile)
    lines = []
    for kind in kinds:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            wall = timed(kind, 2) * 1e3
        if rank != 0:
            continue
        window, busy, copies = _busy_ms(prof.profiler.kineto_results.events())
        lines.append(f"== {name} {kind}: {wall:.1f} ms/step; device window {window:.1f} ms, busy {busy:.1f} ms "
                     f"({busy / window * 100 if window else 0:.1f} %), copies {copies:.1f} ms")
        averages = prof.key_averages()
        lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        lines.append(averages.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=60))
        if args.traces:
            path = folder / f"trace_{name}_{kind}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"summary_{name}.txt").write_text("\n".join(lines))
        print("\n".join(line for line in lines if line.startswith("==")), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, gloo, tiny models: proves the script runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--out", default="bench_ddp.json")
    parser.add_argument("--profile", default=None, help="a folder for a profile summary of 2 steps of each kind (CUDA)")
    parser.add_argument("--traces", action="store_true", help="with --profile: also gzipped chrome traces")
    parser.add_argument("--guards", default="", help="also time the runner with these step_guard modes (e.g. off,device)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.quick:
        args.rounds, args.steps, args.warmup = min(args.rounds, 2), min(args.steps, 2), 1
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else (lambda: torch.autocast("cpu", enabled=False))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for name, (build, make, loss_fn, global_batch, micro) in workloads(args.quick).items():
        if args.models and name not in args.models.split(","):
            continue
        share = global_batch // world
        torch.manual_seed(0)
        kinds = ["hand", "runner", *(f"runner_guard_{g}" for g in args.guards.split(",") if g)]
        models = {kind: torch.nn.parallel.DistributedDataParallel(build().to(device), device_ids=[device.index] if cuda else None)
                  for kind in kinds}
        optimizers = {kind: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for kind, m in models.items()}
        batch = make(share, device)
        runners = {kind: Runner(models[kind], optimizers[kind], loss_fn, global_batch=global_batch, micro_batch=micro,
                                grow_after=None, progress=False, log_every=None, autocast_dtype="bfloat16" if cuda else None,
                                step_guard=kind.rsplit("_", 1)[1] if kind.startswith("runner_guard_") else "auto")
                   for kind in kinds if kind != "hand"}
        times = {kind: [] for kind in kinds}

        def timed(kind: str, steps: int) -> float:
            sync()
            start = time.perf_counter()
            if kind == "hand":
                for _ in range(steps):
                    hand_step(models["hand"], optimizers["hand"], loss_fn, batch, micro, autocast)
            else:
                runner = runners[kind]
                before = runner.step
                runner.fit([batch] * steps, steps=before + steps)  # steps: over the whole run
                assert runner.step == before + steps
            sync()
            return (time.perf_counter() - start) / steps

        for kind in kinds:
            timed(kind, args.warmup)
        for round_ in range(args.rounds):
            for kind in (kinds if round_ % 2 == 0 else kinds[::-1]):
                times[kind].append(timed(kind, args.steps))
        if args.profile and cuda:  # 2 steps of each kind on rank 0: a summary, and a trace with --traces
            profile(args, name, kinds, timed, rank)
        hand = statistics.median(times["hand"])
        medians = {kind: statistics.median(times[kind]) for kind in kinds}
        ours = medians["runner"]
        rows.append({"model": name, "global_batch": global_batch, "micro_batch": micro, "ranks": world,
                     "hand_ms": hand * 1e3, "runner_ms": ours * 1e3, "overhead_pct": (ours / hand - 1) * 100,
                     "variants_ms": {k: round(v * 1e3, 2) for k, v in medians.items()},
                     "rounds": {k: [round(v * 1e3, 2) for v in vs] for k, vs in times.items()},
                     "guard_placement": {k: r.guard.placement for k, r in runners.items()},
                     "recoveries": sum(len(r.result.oom_recoveries) for r in runners.values())})
        del models, optimizers, runners, batch
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        device_name = torch.cuda.get_device_name() if cuda else "cpu (gloo)"
        print(f"device: {world} x {device_name}, torch {torch.__version__}")
        for row in rows:
            print(f"{row['model']:>12}  global {row['global_batch']:>5} micro {row['micro_batch']:>4}: hand {row['hand_ms']:8.1f} ms"
                  f"  runner {row['runner_ms']:8.1f} ms  ({row['overhead_pct']:+.1f} %)  variants {row['variants_ms']}  guard {row['guard_placement']}  rounds {row['rounds']}")
        Path(args.out).write_text(json.dumps({"device": device_name, "ranks": world, "rows": rows}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
