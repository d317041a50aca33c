"""Deterministic workloads for the runner tests (also used by ``resume_worker.py``).

Everything runs in float64, so a run whose micro-batches were split differently after an
OOM differs from an uninjected run only by floating-point summation order. Tolerance used
throughout: ``rtol=1e-10, atol=1e-12``.
"""

from __future__ import annotations

import torch
from torch import nn

RTOL, ATOL = 1e-10, 1e-12
FEATURES = 6


def make_model(seed: int = 0, dropout: float = 0.0, blocks: int = 2, width: int = 16) -> nn.Module:
    """A small float64 MLP; ``blocks`` repeated hidden blocks (checkpointing can wrap them).
    A larger ``width`` makes activations, not parameters, dominate memory."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(FEATURES, width)]
    for _ in range(blocks):
        layers.append(nn.Sequential(nn.Tanh(), nn.Linear(width, width)))
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers).double()


def make_data(samples: int = 48, global_batch: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Global batches ``(x, y, ids)``; ``ids`` are the samples' indices."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randn(samples, 1, generator=generator, dtype=torch.float64)
    ids = torch.arange(samples)
    return [(x[i : i + global_batch], y[i : i + global_batch], ids[i : i + global_batch]) for i in range(0, samples, global_batch)]


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return nn.functional.mse_loss(model(x), y)


def hungry_mse(model: nn.Module, batch) -> torch.Tensor:
    """:func:`mse` plus an exactly-zero term whose graph keeps ~64 KiB per sample alive until
    backward: activations, not parameters, then decide which micro-batch fits a budget.
    The gradients (and so the weights) are those of :func:`mse`."""
    out = model(batch[0])
    ballast = torch.tanh(out.repeat(1, 4096)).mean()
    return nn.functional.mse_loss(out, batch[1]) + 0.0 * ballast


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_weights_close(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    for a, b in zip(left, right, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


class SampleTracker:
    """Which samples contributed to each *applied* optimizer update.

    ``loss_fn`` records each micro-batch's ids in the current attempt; an attempt starts
    over whenever a micro-batch begins at a global batch's first sample (a replay starts
    from the first sample). An optimizer step post-hook moves the attempt's ids to
    ``applied``, so micro-batches of failed attempts are never counted.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, global_batch: int) -> None:
        self.global_batch = global_batch
        self.pending: list[int] = []
        self.applied: list[list[int]] = []
        self.attempt_starts = 0
        optimizer.register_step_post_hook(self._applied)

    def loss_fn(self, model: nn.Module, batch) -> torch.Tensor:
        ids = batch[2].tolist()
        # A fourth field, when present, is each sample's position in its global batch
        # (shuffled data); else ids are contiguous within a global batch.
        first = int(batch[3][0]) if len(batch) > 3 else ids[0] % self.global_batch
        if first == 0:
            self.pending = []
            self.attempt_starts += 1
        else:  # a micro-batch continues where the previous one stopped
            assert self.pending and (len(batch) > 3 or ids[0] == self.pending[-1] + 1), (self.pending, ids)
        self.pending.extend(ids)
        return mse(model, batch)

    def _applied(self, optimizer, args, kwargs) -> None:
        self.applied.append(self.pending)
        self.pending = []
