"""Does the predictive search follow a memory curve that bends? (a contrastive loss, review 14)

A CLIP-style loss scores every image against every text: a B x B logits matrix (fp32, with its
softmax and gradients in both directions), so peak memory is ``a + b*B + c*B^2``. A line through
two passes overshoots such a curve; the probe aims along the parabola through its passes'
peaks (:mod:`autobatch.probe.searching.bent_line`). Two small towers (a conv net on images, an MLP on
token features) make the model; each mode probes it with the default strategy, no estimate, as a
GPU does, and prints one JSON line: the answer, every trial (size, passed, seconds, purpose), the
wall time, and a check in the same process: three steps at the answer and at answer + 1 under the
same cap (``exact``: the answer trains and the size above does not).

    python scripts/diag_bent_predict.py                                   (GPU, 8 GiB cap)
    python scripts/diag_bent_predict.py --device cpu --memory-limit 64MiB --image-size 4 --width 16 --tokens 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autobatch import TrainStep, find_max_batch, is_oom_error, simulated_memory  # noqa: E402
from autobatch.memory.devices import memory_for  # noqa: E402
from autobatch.memory.units import parse_bytes  # noqa: E402


class TwoTowers(nn.Module):
    """An image tower (convolutions, pooled) and a text tower (an MLP over token features, averaged),
    both projected to ``embed`` and normalised; returns the two embeddings."""

    def __init__(self, width: int, embed: int, tokens: int) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.GELU(), nn.Conv2d(width, width, 3, padding=1, stride=2), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, embed))
        self.text = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, embed))
        self.tokens, self.scale = tokens, nn.Parameter(torch.tensor(1 / 0.07).log())

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.image(images), dim=-1)
        b = F.normalize(self.text(texts).mean(dim=1), dim=-1)
        logits = self.scale.exp() * a @ b.T  # B x B, fp32
        target = torch.arange(len(a), device=a.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def build(args, device: torch.device):
    torch.manual_seed(0)
    model = TwoTowers(args.width, args.embed, args.tokens).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch(n: int):
        return (torch.randn(n, 3, args.image_size, args.image_size, device=device),
                torch.randn(n, args.tokens, args.width, device=device))

    return model, optimizer, make_batch


def probe(mode: str, args, device: torch.device, limit: int) -> dict:
    """Probe in ``mode`` and check the answer. On the CPU everything, the model included, runs in
    one simulated budget (a budget opened later would not count the model's and optimizer's bytes)."""
    if device.type != "cpu":
        return _probe(mode, args, device, limit, limit)
    with simulated_memory(limit):
        return _probe(mode, args, device, limit, None)


def _probe(mode: str, args, device: torch.device, limit: int, cap: int | None) -> dict:
    model, optimizer, make_batch = build(args, device)
    step = TrainStep(model, optimizer, lambda m, batch: m(*batch), make_batch)
    began = time.perf_counter()
    if mode == "callable":  # no estimate, as any plain callable; the model put back afterwards
        result = find_max_batch(lambda n: step(n), memory_limit=cap, device=device, restore=(model, optimizer),
                                cache=False)
    else:  # the default strategy; no estimate (a GPU's default) unless --estimate-first
        result = find_max_batch(step, memory_limit=cap, cache=False, estimate_first=args.estimate_first)
    wall = time.perf_counter() - began
    answer = result.batch_size
    row = {"mode": mode, "device": str(device), "answer": answer, "smallest_failed": result.smallest_failed,
           "trials": [(t.batch_size, t.passed, round(t.seconds, 3), t.purpose) for t in result.trials],
           "num_trials": len(result.trials), "wall_s": round(wall, 2), "strategy_used": result.strategy_used,
           "bend_bytes_per_sample2": _bend(result.fit or {})}
    # on an accelerator a step whose allocated peak passes the capacity less the allocator's headroom failed
    peak_limit = limit - (result.fit or {}).get("allocator_headroom_bytes", 0)
    row["check"] = {str(n): trains(step, n, device, cap, peak_limit, args.check_steps) for n in (answer, answer + 1)}
    row["exact"] = row["check"][str(answer)]["trains"] and not row["check"][str(answer + 1)]["trains"]
    return row


def _bend(fit: dict) -> float | None:
    """The parabola's curvature the search last aimed along (None: it followed straight lines)."""
    return fit.get("refined", {}).get("bend_bytes_per_sample2", fit.get("bend_bytes_per_sample2"))


def trains(step, n: int, device: torch.device, cap: int | None, peak_limit: int, steps: int) -> dict:
    """``steps`` steps at ``n`` under the cap: whether they ran without an OOM (anything else is raised)
    and kept their allocated peak within ``peak_limit`` (on the CPU, the simulated budget's peak)."""
    with memory_for(device, cap) as (memory, _):
        memory.reset_peak()
        try:
            for _ in range(steps):
                step(n)
            oom = False
        except Exception as error:  # noqa: BLE001 - only an OOM is an answer
            if not is_oom_error(error):
                raise
            oom = True
        peak = memory.peak()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return {"oom": oom, "peak_bytes": peak, "trains": not oom and peak <= peak_limit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--modes", default="callable,train_step")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=64, help="conv channels and token features")
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--estimate-first", action="store_true", help="train_step: let auto estimate first")
    args = parser.parse_args()
    device, limit = torch.device(args.device), parse_bytes(args.memory_limit, name="--memory-limit")
    for mode in args.modes.split(","):
        print(json.dumps(probe(mode, args, device, limit)), flush=True)


if __name__ == "__main__":
    main()
