"""The data ``python -m autobatch train`` feeds the runner: an iterable of (this rank's share of) global batches.

:class:`~autobatch.Runner` iterates its data once per epoch and, on resume, re-creates the
epoch's iterator under the RNG state saved at the epoch's start and skips the batches already
trained. So the data must be *re-iterable* and draw its randomness from torch's global RNG
when an epoch's iterator is created:

* synthetic data: :class:`SyntheticEpochs` draws one seed (:func:`~autobatch.cli.sharding.epoch_seed`)
  in ``iter()`` and generates every batch of the epoch from a private generator seeded with
  it, so the batches are the same in an uninterrupted and a resumed run, and drawing them
  does not disturb the global RNG that dropout uses;
* a ``_target_`` dataset: a ``DataLoader`` over :class:`~autobatch.cli.sharding.ShardedBatches`
  (one permutation per epoch from the same kind of seed when ``train.shuffle``).

Under ``torchrun`` (a process group of ``W`` ranks) every rank builds the same global batches
and keeps its contiguous block of ``global_batch / W`` samples (:mod:`autobatch.cli.sharding`);
with one process the block is the whole batch.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from ..dist import agreement as dist_sync
from ..workloads.batches import SyntheticBatches
from .build import Workload, synthetic_spec
from .sharding import ShardedBatches, epoch_seed, per_rank_batch, take_share

__all__ = ["SyntheticEpochs", "training_data"]


class SyntheticEpochs:
    """``batches`` global batches of ``global_batch`` synthetic samples per iteration (epoch);
    of each, rank ``rank`` of ``world`` yields its block.

    Batches are built on the CPU (the runner moves each micro-batch to the device). Every rank
    draws the whole global batch and keeps its block, so the data does not depend on the
    number of ranks (the same run on one process trains the same global batches)."""

    def __init__(self, make: SyntheticBatches, global_batch: int, batches: int, *, rank: int = 0, world: int = 1) -> None:
        self.make = make
        self.global_batch = global_batch
        self.batches = batches
        self.rank = rank
        self.world = world

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Any]:
        return self._epoch(epoch_seed())  # drawn now, under the epoch's RNG state

    def _epoch(self, seed: int) -> Iterator[Any]:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(self.batches):
            yield take_share(self.make(self.global_batch, generator=generator), self.rank, self.world)


def training_data(cfg: DictConfig, workload: Workload, global_batch: int) -> Iterable[Any]:
    """This rank's share of global batches of ``global_batch`` samples: one epoch is
    ``data.num_samples`` synthetic samples (rounded up to whole batches), or one pass over the
    ``_target_`` dataset (its last batch may be smaller)."""
    rank, world = dist_sync.rank(), dist_sync.world_size()
    per_rank_batch(global_batch, world)
    if workload.dataset is not None:
        sampler = ShardedBatches(len(workload.dataset), global_batch, shuffle=bool(cfg.train.shuffle), rank=rank, world=world)
        return DataLoader(workload.dataset, batch_sampler=sampler)  # drawn in host memory by the runner
    make = SyntheticBatches(**synthetic_spec(cfg, "cpu"))
    batches = math.ceil(cfg.data.num_samples / global_batch)
    return SyntheticEpochs(make, global_batch, batches, rank=rank, world=world)
