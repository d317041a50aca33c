"""Ranks that train the same number of batches: uneven data is one clear error, never a pairing.

Under ``torch.distributed`` every global step pairs one batch of each rank. Data that yield a
different number of batches on different ranks (an unevenly sharded dataset) used to be paired
across epochs without a word: with 3 batches on rank 0 and 4 on rank 1, rank 0's first batch
of epoch 2 was trained with rank 1's last batch of epoch 1, and rank 0 finished while rank 1
waited for a peer that had left. So the ranks agree on their data's length before each epoch
(one sync point per epoch, :func:`agree_epoch_length`): lengths that differ are an
:class:`UnevenDataError` on every rank before the epoch trains. Where some rank's data has no
trustworthy length (a generator, an ``IterableDataset`` stream), the ranks agree before every
step instead that each of them has a batch (:func:`paced`, one sync point per step and one at
the epoch's end), and the first rank whose data runs out early is the same error on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import UnevenDataError

__all__ = ["UnevenDataError", "trusted_length", "agree_epoch_length", "paced", "every_rank_has"]

_ADVICE = (
    "every rank must yield the same number of batches per epoch (its share of each global batch): "
    "shard the dataset with torch.utils.data.DistributedSampler (it pads every rank to the same "
    "number of samples, or drops the rest with drop_last=True) and a DataLoader with drop_last=True, "
    "or cut every rank's data to the same number of batches"
)


def trusted_length(data: Iterable[Any]) -> int | None:
    """Batches in one pass over ``data`` where ``len`` says it exactly; None for data with no
    length and for a ``DataLoader`` over an ``IterableDataset`` (whose length is a guess)."""
    if isinstance(getattr(data, "dataset", None), torch.utils.data.IterableDataset):
        return None
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def agree_epoch_length(parallel: Any, data: Iterable[Any], epoch: int) -> bool:
    """One sync point before epoch ``epoch`` (0-based) trains: raises :class:`UnevenDataError`
    on every rank when the ranks' lengths differ; returns whether the ranks must check each
    step instead (some rank's length is unknown). ``parallel``: the runner's
    :class:`~autobatch.training.ranks.DataParallel`."""
    length = trusted_length(data)
    lengths = [row[0] for row in parallel.exchange([-1 if length is None else length], f"runner epoch {epoch + 1}: batches per rank")]
    if min(lengths) < 0:
        return True
    if len(set(lengths)) > 1:
        listed = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(lengths))
        raise UnevenDataError(f"the ranks' data have different numbers of batches per epoch ({listed}); {_ADVICE}")
    return False


def paced(parallel: Any, batches: Iterator[Any], step: Callable[[], int], epoch: int, position: Callable[[], int]) -> Iterator[Any]:
    """``batches`` while every rank has one: before each step, and when this rank's data runs
    out, the ranks agree (one sync point) whether each has a batch. All of them: the step
    trains; none: the epoch ends on every rank; some: :class:`UnevenDataError` on every rank.
    ``step()`` and ``position()`` read the runner's global step and place in the epoch."""
    for batch in batches:
        every_rank_has(parallel, True, step(), epoch, position())
        yield batch
    every_rank_has(parallel, False, step(), epoch, position())


def every_rank_has(parallel: Any, has: bool, step: int, epoch: int, position: int) -> None:
    """The sync point before each step (and planning's first draw): every rank says whether it
    drew a batch; where some did and some did not, :class:`UnevenDataError` on every rank."""
    rows = parallel.exchange([int(has), position], f"runner step {step}: every rank has a batch")
    out = [rank for rank, row in enumerate(rows) if not row[0]]
    if out and len(out) < len(rows):
        still = [rank for rank, row in enumerate(rows) if row[0]]
        raise UnevenDataError(
            f"the ranks' data have different numbers of batches: the data of rank {', '.join(map(str, out))} ran "
            f"out after {rows[out[0]][1]} batches of epoch {epoch + 1} while rank {', '.join(map(str, still))} still "
            f"had one; {_ADVICE}"
        )
