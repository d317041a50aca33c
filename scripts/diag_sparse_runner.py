"""A recommender's ``sparse=True`` embedding on the Runner, on any device: SGD with momentum (its
momentum a sparse tensor the step guard must copy), OOMs injected at the optimizer step and in
backward, each ``step_guard`` mode, with and without ``max_grad_norm``, against an unsplit float64
loop (review 33: every such run crashed at its second step before, and clipping raised torch's
"Could not run 'aten::linalg_vector_norm' ... Sparse").

    python scripts/diag_sparse_runner.py --device cuda
    python scripts/diag_sparse_runner.py --device cpu
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autobatch  # noqa: E402
from autobatch import FaultInjector  # noqa: E402
from autobatch.probe.train_step import clip_grad_norm  # noqa: E402


class Recommender(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = torch.nn.EmbeddingBag(4000, 16, sparse=True, mode="mean", dtype=torch.float64)
        self.head = torch.nn.Linear(16, 1, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids)).squeeze(-1)


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def made(device: str):
    torch.manual_seed(0)
    model = Recommender().to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    logging.getLogger("autobatch").setLevel(logging.ERROR)  # the momentum warning, once per runner: expected here
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 4000, (64, 3), generator=generator).to(device),
             torch.randn(64, dtype=torch.float64, generator=generator).to(device)) for _ in range(4)]
    for clip in (None, 0.05):
        reference, optimizer = made(device)
        for batch in data:  # the unsplit loop
            optimizer.zero_grad()
            loss_fn(reference, batch).backward()
            if clip:
                clip_grad_norm(list(reference.parameters()), clip)
            optimizer.step()
        for guard in ("auto", "cpu", "device"):
            model, optimizer = made(device)
            runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=64, micro_batch=32, progress=False,
                                      grow_after=None, step_guard=guard, max_grad_norm=clip,
                                      faults=FaultInjector([(1, "optimizer"), (2, "backward")], times=1))
            result = runner.fit(data, epochs=1)
            diff = max((model.state_dict()[k] - v).abs().max().item() for k, v in reference.state_dict().items())
            print(f"{device} max_grad_norm={clip} step_guard={guard}: {result.steps} steps, "
                  f"{len(result.oom_recoveries)} recoveries, largest weight difference {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
