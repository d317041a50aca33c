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

A rank whose data *raises* while drawing its batch (a corrupt sample, a worker that died) must
not leave its peers in the step's collectives: they would wait there (inside DDP's gradient
buckets, under the default group's timeout, 30 minutes for gloo) for as long as that rank's
process lives on. :func:`carried` turns such an error into a :class:`FailedDraw` that takes the
batch's place: where the ranks agree before each step, that agreement carries it; otherwise the
step does (its first micro-batch raises it, and the step's vote stops every rank). Either way the
rank raises its own error and its peers :class:`~autobatch.errors.PeerFailedError` at once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import PeerFailedError, UnevenDataError

__all__ = ["UnevenDataError", "FailedDraw", "carried", "trusted_length", "agree_epoch_length", "paced", "for_steps", "every_rank_has"]

_ADVICE = (
    "every rank must yield the same number of batches per epoch (its share of each global batch): "
    "shard the dataset with torch.utils.data.DistributedSampler (it pads every rank to the same "
    "number of samples, or drops the rest with drop_last=True) and a DataLoader with drop_last=True, "
    "or cut every rank's data to the same number of batches"
)


class FailedDraw:
    """The place of a batch this rank's data raised ``error`` while drawing (see the module):
    the step's micro-batches read it through :meth:`reraise`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def reraise(self, _piece: Any = None) -> Any:
        raise self.error


def carried(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches``, where an error drawing the next one becomes a :class:`FailedDraw` (the last
    item): the ranks' agreement or the step raises it, so the peers learn of it at once."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - not swallowed: raised again where every rank votes
            yield FailedDraw(exc)
            return
        yield batch


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
        failure = batch.error if isinstance(batch, FailedDraw) else None
        every_rank_has(parallel, True, step(), epoch, position(), failure=failure)
        yield batch
    every_rank_has(parallel, False, step(), epoch, position())


def for_steps(parallel: Any, batches: Iterator[Any], each_step: bool, step: Callable[[], int], epoch: int,
              position: Callable[[], int]) -> Iterator[Any]:
    """An epoch's ``batches`` as the runner's step loop takes them. Alone (``parallel`` None): as
    they are. Under ``torch.distributed``: an error drawing one is :func:`carried` to where every
    rank votes, and with ``each_step`` (some rank's data has no length) each batch is checked to
    be there on every rank before its step (:func:`paced`)."""
    if parallel is None:
        return batches
    batches = carried(batches)
    return paced(parallel, batches, step, epoch, position) if each_step else batches


def every_rank_has(parallel: Any, has: bool, step: int, epoch: int, position: int, *,
                   failure: Exception | None = None) -> None:
    """The sync point before each step (and planning's first draw): every rank says whether it
    drew a batch; where some did and some did not, :class:`UnevenDataError` on every rank.
    ``failure``: this rank's data raised it while drawing; it raises it, its peers
    :class:`~autobatch.errors.PeerFailedError`."""
    rows = parallel.exchange([int(has), position, int(failure is not None)], f"runner step {step}: every rank has a batch")
    failed = [rank for rank, row in enumerate(rows) if row[2]]
    if failure is not None:
        raise failure
    if failed:
        raise PeerFailedError(
            f"the data of rank {', '.join(map(str, failed))} raised an error drawing its batch for step {step} "
            f"(see that rank's log); rank {parallel.rank()} stops too instead of waiting for it", failed)
    out = [rank for rank, row in enumerate(rows) if not row[0]]
    if out and len(out) < len(rows):
        still = [rank for rank, row in enumerate(rows) if row[0]]
        raise UnevenDataError(
            f"the ranks' data have different numbers of batches: the data of rank {', '.join(map(str, out))} ran "
            f"out after {rows[out[0]][1]} batches of epoch {epoch + 1} while rank {', '.join(map(str, still))} still "
            f"had one; {_ADVICE}"
        )
