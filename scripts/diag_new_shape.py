"""What does a step at a batch size not run before cost, and where does it go? (issue 16)

A probe's trials each run a new size; a model whose first step at a new shape is slow pays that
at every trial. For each model: the first step at each size (synchronised), a steady step, and a
profile of one new-size step (the operators with the largest own CPU time).

    python scripts/diag_new_shape.py --models convnext_tiny,efficientnet_b0,resnet50 --sizes 8,16,40,41
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn import functional as F


def step_fn(model, optimizer, device):
    def step(b: int) -> None:
        x = torch.randn(b, 3, 224, 224, device=device)
        y = torch.randint(0, 10, (b,), device=device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
    return step


def timed(step, b: int) -> float:
    began = time.perf_counter()
    step(b)
    return round(time.perf_counter() - began, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="convnext_tiny,efficientnet_b0,resnet50")
    parser.add_argument("--sizes", default="8,16,40,41")
    parser.add_argument("--benchmark", action="store_true")
    parser.add_argument("--profile-size", type=int, default=42)
    args = parser.parse_args()
    import torchvision.models as models

    torch.backends.cudnn.benchmark = args.benchmark
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = getattr(models, name)(num_classes=10).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = step_fn(model, optimizer, "cuda")
        row = {"model": name, "benchmark": args.benchmark, "first": {}, "second": {}}
        for b in (int(s) for s in args.sizes.split(",")):
            row["first"][b] = timed(step, b)
            row["second"][b] = timed(step, b)
        for label, flag in (("cudnn_off", False),):
            torch.backends.cudnn.enabled = flag
            row[label] = timed(step, args.profile_size + 7)
            torch.backends.cudnn.enabled = True
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(args.profile_size)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        print(json.dumps(row))
        print(table)


if __name__ == "__main__":
    main()
