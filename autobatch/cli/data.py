"""The data ``python -m autobatch train`` feeds the runner: an iterable of global batches.

:class:`~autobatch.Runner` iterates its data once per epoch and, on resume, re-creates the
epoch's iterator under the RNG state saved at the epoch's start and skips the batches already
trained. So the data must be *re-iterable* and draw its randomness from torch's global RNG
when an epoch's iterator is created:

* synthetic data: :class:`SyntheticEpochs` draws one seed from the global RNG in ``iter()``
  and generates every batch of the epoch from a private generator seeded with it, so the
  batches are the same in an uninterrupted and a resumed run, and drawing them does not
  disturb the global RNG that dropout uses;
* a ``_target_`` dataset: a ``DataLoader`` with ``batch_size=global_batch`` (its shuffle
  order comes from the global RNG, which the runner restores).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from ..batches import SyntheticBatches
from .build import Workload, synthetic_spec

__all__ = ["SyntheticEpochs", "training_data"]


class SyntheticEpochs:
    """``batches`` global batches of ``global_batch`` synthetic samples per iteration (epoch).

    Batches are built on the CPU (the runner moves each micro-batch to the device)."""

    def __init__(self, make: SyntheticBatches, global_batch: int, batches: int) -> None:
        self.make = make
        self.global_batch = global_batch
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Any]:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # drawn now, under the epoch's RNG state
        return self._epoch(seed)

    def _epoch(self, seed: int) -> Iterator[Any]:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(self.batches):
            yield self.make(self.global_batch, generator=generator)


def training_data(cfg: DictConfig, workload: Workload, global_batch: int) -> Iterable[Any]:
    """Global batches of ``global_batch`` samples: one epoch is ``data.num_samples`` synthetic
    samples (rounded up to whole batches), or one pass over the ``_target_`` dataset."""
    if workload.dataset is not None:
        return DataLoader(workload.dataset, batch_size=global_batch, shuffle=bool(cfg.train.shuffle))
    make = SyntheticBatches(**synthetic_spec(cfg, "cpu"))
    return SyntheticEpochs(make, global_batch, math.ceil(cfg.data.num_samples / global_batch))
