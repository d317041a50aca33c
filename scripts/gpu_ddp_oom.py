"""A real one-rank OOM under DDP on 2 GPUs, recovered with no hang (issue 17).

    torchrun --nproc_per_node=2 scripts/gpu_ddp_oom.py             # 2 GPUs, NCCL
    torchrun --nproc_per_node=2 scripts/gpu_ddp_oom.py --quick     # CPU, gloo: proves it runs

Probes the micro-batch through DDP (``find_max_batch`` on the DDP ``TrainStep``: the real DDP
step), trains at it, and after step 2 rank 1 alone allocates a third of its GPU's memory
and holds it: rank 1's next step runs out of memory for real (wherever it strikes: forward,
backward with buckets in flight, optimizer). Checks, printed by rank 0 and written to
``--out``: both ranks finished every step, no sample lost (samples == steps x global
batch), the recoveries (rank 1's own OOM, rank 0's PeerOutOfMemoryError), and the ranks'
weights are bit-identical (a checksum all-gathered). Exit code 0 only when all hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner, TrainStep, find_max_batch  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from bench_ddp import GPT  # noqa: E402


def loss_fn(model, batch):
    out = model(batch[0])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), batch[1].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="gpu_ddp_oom.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dist_sync.init_from_env("cuda" if cuda else "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    vocab, seq, dim, layers = (8192, 512, 1024, 8) if cuda else (64, 16, 16, 2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(vocab, seq, dim, layers, 8 if cuda else 2).to(device),
                                                      device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + rank)

    def make_batch(n: int):
        ids = torch.randint(0, vocab, (n, seq), generator=generator).to(device)
        return ids, ids

    autocast = torch.bfloat16 if cuda else None
    probe = find_max_batch(TrainStep(model, optimizer, loss_fn, make_batch, autocast_dtype=autocast),
                           max_batch=512 if cuda else 8, steps_per_trial=2, cache=False)
    micro = probe.batch_size
    share = micro * 4
    global_batch = share * world
    data = [make_batch(share) for _ in range(args.steps)]
    runner = Runner(model, optimizer, loss_fn, global_batch=global_batch, micro_batch=micro, grow_after=None,
                    progress=False, log_every=None, autocast_dtype="bfloat16" if cuda else None)
    hog = []

    def on_step_end(info):
        if info["step"] == 2 and rank == 1:
            if cuda:
                total = torch.cuda.get_device_properties(device).total_memory
                hog.append(torch.empty(total // 3, dtype=torch.uint8, device=device))
            else:  # the CPU has no memory to exhaust: an injected OOM at the next step instead
                from autobatch import inject_oom

                inject_oom(runner, at=(3, "backward"))

    result = runner.fit(data, steps=args.steps, on_step_end=on_step_end)
    checksum = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "probe_micro_batch": micro, "global_batch": global_batch,
        "steps": result.steps, "samples": result.samples, "recoveries": result.oom_recoveries,
        "final_micro_batch": result.micro_batch, "checksums": [float(g.item()) for g in gathered],
    }
    ok = (result.steps == args.steps and result.samples == args.steps * global_batch and len(result.oom_recoveries) >= 1
          and len(set(report["checksums"])) == 1)
    report["ok"] = ok
    if rank == 0:
        print(json.dumps(report, indent=2))
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
