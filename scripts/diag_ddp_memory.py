"""What ``DistributedDataParallel`` adds to a training step's device memory (run under torchrun).

GPT-2 small (from its config, bf16 autocast, AdamW, 256-token samples) at ``--batch``: the
allocated memory after the wrap, and each step's allocated peak and the memory after it, for
the model unwrapped (this rank alone) and wrapped in DDP with ``gradient_as_bucket_view`` off
and on, and with ``find_unused_parameters`` (the ``transformers.Trainer``'s default). Rank 0 prints one JSON line per variant:

    torchrun --nproc-per-node 2 scripts/diag_ddp_memory.py --batch 16
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist
import transformers


def mib(value: int) -> float:
    return round(value / 2**20, 1)


def variant(name: str, batch: int, tokens: int, steps: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=tokens)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    wrapped = model if name == "unwrapped" else torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index], gradient_as_bucket_view=name == "ddp_bucket_view",
        find_unused_parameters=name == "ddp_find_unused")
    row = {"variant": name, "wrap_mib": mib(torch.cuda.memory_allocated() - before), "steps": []}
    ids = torch.randint(0, 50257, (batch, tokens), device=device)
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        row["steps"].append([mib(start - before), mib(torch.cuda.max_memory_allocated() - before),
                             mib(torch.cuda.memory_allocated() - before)])
    del wrapped, model, optimizer, ids, loss
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    for name in ("unwrapped", "ddp", "ddp_bucket_view", "ddp_find_unused"):
        row = variant(name, args.batch, args.tokens, args.steps, device)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
