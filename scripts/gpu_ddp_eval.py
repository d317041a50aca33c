"""DDP with BatchNorm on real GPUs: rank 0 evaluates alone between runner steps and after ``fit``.

    torchrun --nproc_per_node=2 scripts/gpu_ddp_eval.py            # 2 GPUs, NCCL
    torchrun --nproc_per_node=2 scripts/gpu_ddp_eval.py --quick    # CPU, gloo: proves it runs

A ``Runner`` trains ``DistributedDataParallel`` over a small CNN with ``BatchNorm2d`` through DDP's
reducer; its ``on_step_end`` has rank 0 alone run ``model.eval()`` and a forward under
``torch.no_grad()`` (a validation pass), and rank 0 evaluates once more after ``fit``. DDP's buffer
broadcast is made at the end of each step (``autobatch.dist.ddp_step.settle``), so those forwards
run no collective: before, rank 0's evaluation entered DDP's buffer broadcast alone and both ranks
waited out the sync deadline. Then the same model with ``SyncBatchNorm`` trains two steps, with the
warning that its OOMs cannot be replayed. Checks, printed by rank 0: every step ran, the ranks'
parameters and buffers are bit-identical (a checksum all-gathered), the warning was given. Exit
code 0 only when all hold.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autobatch import Runner  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                         nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def checksum(model: nn.Module) -> torch.Tensor:
    """Every parameter's and buffer's sum, in float64 (equal only where the ranks agree bit for bit)."""
    return torch.stack([t.detach().double().sum() for t in [*model.parameters(), *model.buffers()]])


def train(module: nn.Module, device: torch.device, rank: int, world: int, steps: int) -> tuple[int, int, torch.Tensor]:
    """Train ``DDP(module)`` ``steps`` steps with rank 0 evaluating alone after each and after fit:
    (steps run, evaluations made, the trained module's :func:`checksum`)."""
    model = nn.parallel.DistributedDataParallel(module.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    generator = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(32, 3, 32, 32, generator=generator).to(device), torch.randint(0, 10, (32,), generator=generator).to(device))
            for _ in range(steps)]
    probe = torch.randn(16, 3, 32, 32).to(device)
    evaluations = [0]

    def evaluate(_info=None):
        if rank == 0:
            model.eval()
            with torch.no_grad():
                model(probe)
            model.train()
            evaluations[0] += 1

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.05), loss_fn, global_batch=32 * world, micro_batch=16,
                    grow_after=None, progress=False, log_every=None)
    result = runner.fit(data, on_step_end=evaluate)
    evaluate()
    return result.steps, evaluations[0], checksum(model.module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    dist_sync.init_from_env("cuda" if cuda else "cpu")
    dist_sync.set_timeout(30)  # a rank left alone in a collective is an error in 30 s, not a hang
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    began = time.perf_counter()
    failures: list[str] = []
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("autobatch").addHandler(handler)
    runs = [("BatchNorm2d", cnn(), args.steps)]
    if cuda:  # SyncBatchNorm runs on GPUs only
        runs.append(("SyncBatchNorm", nn.SyncBatchNorm.convert_sync_batchnorm(cnn()), 2))
    for name, module, wanted in runs:
        steps, evaluations, sums = train(module, device, rank, world, wanted)
        if steps != wanted or (rank == 0 and evaluations != wanted + 1):
            failures.append(f"{name}, rank {rank}: {steps} steps, {evaluations} evaluations")
        gathered = [torch.zeros_like(sums) for _ in range(world)]
        dist.all_gather(gathered, sums)
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            failures.append(f"{name}: the ranks' parameters or buffers differ after fit")
    if cuda and not any("SyncBatchNorm" in message for message in warned):
        failures.append(f"rank {rank}: no SyncBatchNorm warning")
    seconds = torch.tensor([time.perf_counter() - began], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    all_failures: list = [None] * world
    dist.all_gather_object(all_failures, failures)
    if rank == 0:
        flat = [f for fs in all_failures for f in fs]
        print(f"ddp eval on rank 0 alone: {', '.join(name for name, _, _ in runs)}, {seconds.item():.1f} s; "
              + ("ok" if not flat else "FAIL: " + "; ".join(flat)))
    dist.destroy_process_group()
    sys.exit(1 if any(all_failures) else 0)


if __name__ == "__main__":
    main()
