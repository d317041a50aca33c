"""Each rank's share of the global batches under ``torchrun``: disjoint, together the whole batch.

The distributed :class:`~autobatch.Runner` takes ``global_batch`` as global across the ranks
and expects each rank's data to yield its share. The CLI's data (:mod:`autobatch.cli.data`)
therefore builds the *same* global batches on every rank, in the same order, and each rank
keeps one contiguous block of every batch: rank ``r`` of ``W`` takes samples
``[r * G/W, (r + 1) * G/W)`` of a global batch of ``G``. So

* the blocks are disjoint and cover the global batch exactly; one step trains the same
  samples as a single process would on that global batch, and the runner's gradient
  all-reduce (weighted by share) gives the same update up to floating-point summation order;
* the global batches do not depend on the number of ranks: one process trains the same
  global batches as ``W`` ranks do;
* shuffling is one permutation per epoch from a seed that every rank takes from rank 0
  (like ``DistributedSampler`` with ``seed + epoch``), drawn from torch's global RNG when the
  epoch's iterator is created: the runner restores that RNG state on resume, so a resumed
  run draws the same permutation again.

A global batch that does not split evenly over the ranks is a config error
(:func:`per_rank_batch`). A last, partial batch of an epoch (a dataset whose size is not a
multiple of the global batch) is split as evenly as possible (shares differ by at most one,
which the runner weights correctly); one with fewer samples than ranks is dropped, since some
rank would have nothing to train.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from ..dist import agreement as dist_sync
from ..planning.accumulation import batch_size_of
from ..planning.batch_nodes import picked
from ..planning.samples import map_samples

__all__ = ["per_rank_batch", "share_bounds", "take_share", "epoch_seed", "ShardedBatches"]

log = logging.getLogger("autobatch")


def per_rank_batch(global_batch: int, world: int, key: str = "train.global_batch", *, resumed: bool = False) -> int:
    """Each rank's samples per step; ``ValueError`` naming ``key`` when ``world`` does not
    divide ``global_batch``. A ``resumed`` run's global batch is its checkpoint's, which cannot
    change: the fix named is a number of ranks that divides it (before, a resume under 3 ranks of
    a global batch of 16 was told to use "the checkpoint's train.global_batch=15 or 18")."""
    if global_batch % world:
        lower = global_batch - global_batch % world
        fix = f"use a multiple of {world}, " + (f"e.g. {key}={lower} or {lower + world}" if lower else f"e.g. {key}={world}")
        if resumed:
            fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
            near = [max(n for n in fits if n < world)] + [n for n in fits if n > world][:1]
            fix = (f"a resumed run keeps it, so resume under a number of ranks that divides it, e.g. torchrun "
                   f"--nproc-per-node {' or '.join(map(str, near))}")
        raise ValueError(f"{key}={global_batch} does not split evenly over {world} ranks (torchrun --nproc-per-node {world}); {fix}")
    return global_batch // world


def share_bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank`` 's contiguous block of a global batch of ``size`` samples:
    ``size / world`` each when it divides, else sizes that differ by at most one (larger first)."""
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def take_share(batch: Any, rank: int, world: int) -> Any:
    """``rank`` 's block of ``batch``'s samples, as a copy so that the rest of the global batch is
    freed; ``batch`` itself when ``world`` is 1. Per sample as the runner cuts it
    (:func:`~autobatch.planning.samples.map_samples`): tensors on dim 0, and lists of per-sample
    entries too (file names, a detection collate's dicts: every rank kept all of them), and NumPy
    arrays as long as the batch (a copy of the rank's rows); a 0-dim tensor is shared."""
    if world == 1:
        return batch
    total = batch_size_of(batch)
    start, stop = share_bounds(total, rank, world)
    return map_samples(batch, lambda tensor: tensor[start:stop].clone(),
                       lambda found: picked(found, range(start, stop)), total)


def epoch_seed() -> int:
    """A seed for one epoch's data, drawn from torch's global RNG; under a process group of
    several ranks, rank 0's (one sync point), so every rank builds the same batches."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    if dist_sync.is_distributed():
        seed = dist_sync.exchange([seed], "data: epoch seed")[0][0]
    return seed


class ShardedBatches(Sampler[list[int]]):
    """A ``DataLoader`` batch sampler: for each global batch of ``global_batch`` dataset
    indices, this rank's block of them.

    The epoch's order is ``randperm(num_samples)`` under :func:`epoch_seed` (``shuffle``), else
    ``0 .. num_samples - 1``; it is drawn when the epoch's iterator is created. ``rank`` and
    ``world`` default to the process group's (0 and 1 without one).
    """

    def __init__(self, num_samples: int, global_batch: int, *, shuffle: bool, rank: int | None = None, world: int | None = None) -> None:
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.shuffle = shuffle
        self.rank = dist_sync.rank() if rank is None else rank
        self.world = dist_sync.world_size() if world is None else world
        full, tail = divmod(num_samples, global_batch)
        if 0 < tail < self.world:
            log.warning(
                "the last %d samples of each epoch are not trained: fewer than the %d ranks (the epoch has %d "
                "samples, the global batch is %d)", tail, self.world, num_samples, global_batch,
            )  # fmt: skip
            tail = 0
        self.tail = tail
        self.batches = full + (1 if tail else 0)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:  # drawn now, under the epoch's RNG state (not at the first next())
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(epoch_seed()))
        else:
            order = torch.arange(self.num_samples)
        return self._epoch(order.tolist())

    def _epoch(self, order: list[int]) -> Iterator[list[int]]:
        for index in range(self.batches):
            batch = order[index * self.global_batch : (index + 1) * self.global_batch]
            start, stop = share_bounds(len(batch), self.rank, self.world)
            yield batch[start:stop]

