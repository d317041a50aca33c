#!/usr/bin/env python
"""The README's memory-curve plot, from a real probe on a GPU.

Probes a ResNet-50 (torchvision; without it, autobatch's ResNetCNN at ResNet-18 size) with
AdamW under bf16 autocast, capped at --memory-limit, through ``autobatch.plan(objective=
"throughput")``: the plan's probe gives the memory curve, its timed candidates the
throughput panel. Writes into --out:

* ``memory_curve_gpu.png``: :func:`autobatch.plot_probe` of the probe, with the plan;
* ``memory_curve_gpu.json``: the probe result (diagnostics included), the plan, the device,
  torch's version and the command.

    python scripts/gpu_plot.py --out docs                        # on the GPU machine
    python scripts/gpu_plot.py --device cpu --out /tmp/gpu_plot   # a quick check without one
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autobatch  # noqa: E402
import autobatch.workloads.models  # noqa: E402


def build_model(name: str, small: bool) -> tuple[torch.nn.Module, str]:
    """(model, its description): torchvision's resnet50 when asked and installed; ``small``
    (the CPU check) a small ResNetCNN."""
    if small:
        return autobatch.workloads.models.ResNetCNN(in_channels=3, num_classes=1000, width=16, stages=3), "ResNetCNN (small)"
    if name == "resnet50":
        try:
            import torchvision

            return torchvision.models.resnet50(num_classes=1000), "ResNet-50 (torchvision)"
        except ImportError:
            logging.warning("torchvision is not installed; using autobatch.workloads.models.ResNetCNN at ResNet-18 size")
    model = autobatch.workloads.models.ResNetCNN(in_channels=3, num_classes=1000, width=64, stages=4, blocks_per_stage=2)
    return model, "ResNetCNN (ResNet-18 size, autobatch.workloads.models)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="directory for the PNG and JSON")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a quick check")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "cnn"))
    parser.add_argument("--memory-limit", default=None, help="cap (default: 16GiB on cuda, 64MiB on cpu)")
    parser.add_argument("--image-size", type=int, default=None, help="default: 224 on cuda, 32 on cpu")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="plan's global batch; keep it above the boundary (default: 2048 on cuda, 256 on cpu)")
    parser.add_argument("--strategy", default="auto", choices=("auto", "predict", "binary", "power", "halving"))
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--no-throughput", action="store_true", help="probe only: no timed candidates")
    parser.add_argument("--name", default="memory_curve_gpu", help="file name stem of the outputs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("CUDA is not available; pass --device cpu for a check without a GPU")
    memory_limit = args.memory_limit or ("16GiB" if cuda else "64MiB")
    size = args.image_size or (224 if cuda else 32)
    global_batch = args.global_batch or (2048 if cuda else 256)
    device = torch.device(args.device)

    torch.manual_seed(0)
    model, description = build_model(args.model, small=not cuda)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def make_batch(n: int):
        return torch.randn(n, 3, size, size, device=device), torch.randint(0, 1000, (n,), device=device)

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    precision = torch.bfloat16 if cuda else None
    step = autobatch.TrainStep(model, optimizer, loss_fn, make_batch, autocast_dtype=precision)
    probe_args = dict(strategy=args.strategy, margin=args.margin, memory_limit=memory_limit, steps_per_trial=3, cache=False)

    began = time.perf_counter()
    plan = None
    if args.no_throughput:
        result = autobatch.find_max_batch(step, max_batch=global_batch, **probe_args)
    else:
        plan = autobatch.plan(step, global_batch=global_batch, objective="throughput", **probe_args)
        result = plan.probe_results[0]
    elapsed = time.perf_counter() - began
    if result.largest_passed == global_batch:
        logging.warning("the probe reached the global batch %d: raise --global-batch to see the boundary", global_batch)

    device_name = torch.cuda.get_device_name(device) if cuda else "CPU (simulated budget)"
    precision_name = "bf16 autocast" if precision is not None else "fp32"
    title = (
        f"{description}, AdamW, {precision_name}, {size}x{size}, cap {memory_limit}\n"
        f"{device_name}: batch {result.batch_size} ({result.strategy_used}, {result.num_trials} trials, "
        f"{result.num_ooms} OOM, {result.elapsed_s:.1f} s)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    png = autobatch.plot_probe(result, args.out / f"{args.name}.png", plan=plan, title=title)
    record = {
        "device": device_name,
        "torch": torch.__version__,
        "model": description,
        "precision": precision_name,
        "image_size": size,
        "memory_limit": memory_limit,
        "global_batch": global_batch,
        "seconds": round(elapsed, 2),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "result": result.to_dict(),
        "plan": None if plan is None else plan.to_dict(),
    }
    json_path = args.out / f"{args.name}.json"
    json_path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    print(result.summary())
    if plan is not None:
        print(plan.summary())
    print(f"plot            {png}")
    print(f"json            {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
