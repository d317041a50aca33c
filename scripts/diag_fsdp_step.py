"""Where an FSDP2 runner step's time goes, against a hand-written FSDP2 loop (2 ranks).

    torchrun --nproc-per-node 2 scripts/diag_fsdp_step.py [--micro 9] [--steps 20] [--rounds 2]

Same model, data and caps as ``scripts/bench_fsdp.py`` (no probe: ``--micro`` is the micro-batch).
Variants, interleaved over ``--rounds``: the hand loop; the runner with each ``step_guard``
(off, cpu, device, auto); the runner without the guard and with FSDP's votes stubbed out
(what the votes cost). Prints per-step seconds (median over rounds), the votes per step and
their host seconds, and whether the guard's host buffers are pinned.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_fsdp  # noqa: E402
from autobatch import Runner  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from autobatch.dist import fsdp_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--caps", default="40,30")
    parser.add_argument("--variants", default="hand,off,novote,cpu,device,auto")
    parser.add_argument("--out", default=None)
    mine = parser.parse_args()
    sys.argv = [sys.argv[0], "--caps", mine.caps]
    args = bench_fsdp.parse()
    dist_sync.init_from_env("cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    bench_fsdp.cap(args, rank, device)
    model, optimizer = bench_fsdp.build(args, device)
    generator = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, args.vocab, (mine.micro, args.seq), generator=generator) for _ in range(mine.steps)]
    autocast = torch.bfloat16

    def hand(batches):
        for tokens in batches:
            with torch.autocast("cuda", dtype=autocast):
                loss = bench_fsdp.loss_fn(model, tokens.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()

    votes = bench_fsdp._count_votes(fsdp_guard, "exchange_via_store")  # the FSDP votes' exchange, timed
    real_check = fsdp_guard._check
    def make_runner(name):
        guard = "off" if name == "novote" else name
        return Runner(model, optimizer, bench_fsdp.loss_fn, global_batch=mine.micro * world, micro_batch=mine.micro,
                      device=device, autocast_dtype=autocast, progress=False, log_every=None, grow_after=0,
                      step_guard=guard)

    hand(data[:2])
    times: dict[str, list[float]] = {name: [] for name in mine.variants.split(",")}
    vote_rows: dict[str, list[float]] = {}
    guards: dict[str, dict] = {}
    for _ in range(mine.rounds):
        for name in times:  # one runner at a time: a device guard's buffers go with it
            fsdp_guard._check = (lambda kind: None) if name == "novote" else real_check
            runner = None
            if name != "hand":
                runner = make_runner(name)
                runner.fit(data[:2], epochs=1)  # warm-up: the guard's buffers
            votes["clear"]()
            torch.cuda.synchronize(device)
            dist.barrier()
            began = time.perf_counter()
            if runner is None:
                hand(data)
            else:
                done = runner.fit(data, steps=runner.step + mine.steps)
            torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - began) / mine.steps)
            vote_rows[name] = [votes["count"] / mine.steps, votes["seconds"] / mine.steps]
            if runner is not None:
                buffers = list(runner.guard._buffers.values()) if runner.guard is not None else []
                cpu = [b for b in buffers if b.device.type == "cpu"]
                guards[name] = {"placement": getattr(runner.guard, "placement", None), "buffers": len(buffers),
                                "host_pinned": sum(b.is_pinned() for b in cpu), "host": len(cpu),
                                "bytes": sum(b.numel() * b.element_size() for b in buffers),
                                "recoveries": len(done.oom_recoveries), "micro_after": runner.micro_batch}
            del runner
            torch.cuda.empty_cache()
    fsdp_guard._check = real_check
    report = {"rank": rank, "device": torch.cuda.get_device_name(device), "micro": mine.micro,
              "step_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
              "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
              "votes_per_step": {k: [round(v[0], 1), round(v[1], 4)] for k, v in vote_rows.items()}}
    report["guards"] = guards
    report["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print(json.dumps(report), flush=True)
    if mine.out:
        Path(f"{mine.out}.{rank}.json").write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
