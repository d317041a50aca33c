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
The runner's ``on_step_end`` hook raising on some ranks is carried the same way
(:mod:`autobatch.training.step_end`): :func:`carried` puts its :class:`FailedDraw` in place of
the next batch drawn (``pending``), and :func:`every_rank_returned` carries one left after the
run's last step. Inside the step the error travels as :class:`RaisedBeforeStep`, which is never
an OOM to the step's vote: a ``torch.OutOfMemoryError`` of the hook's own evaluation, carried
as itself, was taken for the next step's and replayed at ever smaller micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import PeerFailedError, UnevenDataError, add_note
from ..memory.oom import is_oom_error
from ..memory.units import counted

__all__ = ["UnevenDataError", "FailedDraw", "RaisedBeforeStep", "carried", "carried_error", "trusted_length", "agree_epoch_length", "paced",
           "for_steps", "every_rank_has", "every_rank_returned", "told_every_rank", "was_told"]

_ADVICE = (
    "every rank must yield the same number of batches per epoch (its share of each global batch): "
    "shard the dataset with torch.utils.data.DistributedSampler (it pads every rank to the same "
    "number of samples, or drops the rest with drop_last=True) and a DataLoader with drop_last=True, "
    "or cut every rank's data to the same number of batches"
)


class FailedDraw:
    """The place of a batch this rank's data raised ``error`` while drawing (see the module), or,
    with ``after``, of the one after an ``on_step_end`` that raised ``error`` after ``after``
    steps: the step's micro-batches read it through :meth:`reraise`."""

    def __init__(self, error: Exception, after: int | None = None) -> None:
        self.error = error
        self.after = after

    def kind(self) -> int:
        """What raised it, as a vote carries it: 1 the data, 2 ``on_step_end``."""
        return 1 if self.after is None else 2

    def told(self, step: int) -> str:
        """Where and what this rank raised, for its peers' message (``step``: the step it drew for)."""
        where = f"drawing its batch for step {step}" if self.after is None else f"after {_steps(self.after)}"
        return f"{where} ({self.summary()})"

    def summary(self) -> str:
        """The error's type and first line; an OOM's message is left out (the allocator's long
        text is in that rank's log). A peer's error that quotes this summary is never an OOM of
        the peer's own: :func:`~autobatch.is_oom_error` skips errors between ranks
        (``PeerFailedError.quotes_peers``)."""
        if is_oom_error(self.error):
            return f"{type(self.error).__name__}: ran out of memory (the message is in that rank's log)"
        first = (str(self.error).strip().splitlines() or [""])[0][:240]
        return type(self.error).__name__ + (f": {first}" if first else "")

    def reraise(self, _piece: Any = None) -> Any:
        raise RaisedBeforeStep(self)


class RaisedBeforeStep(Exception):
    """This rank's error from before the step (:class:`FailedDraw`), raised inside the step so
    its vote stops every rank. Not a ``RuntimeError``: never an OOM to the vote and the replay,
    whatever its error (a hook's ``torch.OutOfMemoryError`` is not the step's). The runner raises
    ``failed.error`` itself once the step is undone; the text is what the peers' error names."""

    def __init__(self, failed: FailedDraw) -> None:
        self.failed = failed
        where = "drawing its batch" if failed.after is None else f"on_step_end after {_steps(failed.after)}"
        super().__init__(f"{where}: {failed.summary()}")


def told_every_rank(error: BaseException) -> BaseException:
    """``error``, marked as this rank's own error that a sync point has already told every rank
    of (its peers raise a ``PeerFailedError`` there): where ``on_step_end`` raises it (a
    ``runner.save()`` in the hook whose write failed on this rank), it is raised at once, not
    carried to a next step its peers will not come to."""
    error._autobatch_told = True  # type: ignore[attr-defined]
    return error


def was_told(error: BaseException) -> bool:
    """Whether :func:`told_every_rank` marked ``error``."""
    return getattr(error, "_autobatch_told", False) is True


def _steps(count: int) -> str:
    return counted(count, "step")


def carried_error(check: Callable[[], Any], distributed: bool) -> Any:
    """``check()``, or under torch.distributed its error (an ``Exception``: an interrupt stops at
    once) as a :class:`FailedDraw`, so the step raises it where every rank votes. Why: a rank whose
    batch could not be sized or cut (an empty batch, a short one ``min_micro_batch`` cannot cut)
    raised before the step, and its peers waited in DDP's next collective until the process
    group's timeout (30 min for gloo), then raised a disagreement that did not name its error."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - carried to the vote, raised there on this rank
        if not distributed:
            raise
        return FailedDraw(exc)


def carried(batches: Iterable[Any], pending: Callable[[], FailedDraw | None] = lambda: None) -> Iterator[Any]:
    """``batches``, where an error drawing the next one becomes a :class:`FailedDraw` (the last
    item): the ranks' agreement or the step raises it, so the peers learn of it at once.
    ``pending()``: this rank's ``on_step_end`` error not raised yet (taken: None the next time),
    put in place of the next item drawn; the draw is still made, as every rank makes it (where
    the epoch ends instead, the next epoch's first draw or the run's end carries it)."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - not swallowed: raised again where every rank votes
            batch = FailedDraw(exc)
        failed = pending()
        if failed is not None:
            if isinstance(batch, FailedDraw):  # the earlier error is raised; this one is told in it
                add_note(failed.error, f"autobatch: drawing the next batch raised too: {batch.error!r}")
            batch = failed
        yield batch
        if isinstance(batch, FailedDraw):
            return


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
        failure = batch if isinstance(batch, FailedDraw) else None
        every_rank_has(parallel, True, step(), epoch, position(), failure=failure)
        yield batch
    every_rank_has(parallel, False, step(), epoch, position())


def for_steps(parallel: Any, batches: Iterator[Any], each_step: bool, step: Callable[[], int], epoch: int,
              position: Callable[[], int], pending: Callable[[], FailedDraw | None] = lambda: None,
              kept: Callable[[Exception], BaseException] = lambda exc: exc) -> Iterator[Any]:
    """An epoch's ``batches`` as the runner's step loop takes them. Alone (``parallel`` None): as
    they are, but an error drawing one is raised as ``kept(error)`` returns it (:func:`drawn`).
    Under ``torch.distributed``: an error drawing one, or this rank's ``pending()``
    ``on_step_end`` error, is :func:`carried` to where every rank votes, and with ``each_step``
    (some rank's data has no length) each batch is checked to be there on every rank before its
    step (:func:`paced`)."""
    if parallel is None:
        return drawn(batches, kept)
    batches = carried(batches, pending)
    return paced(parallel, batches, step, epoch, position) if each_step else batches


def drawn(batches: Iterator[Any], kept: Callable[[Exception], BaseException]) -> Iterator[Any]:
    """``batches``, where an error the data raises while a batch is drawn (a corrupt sample, a
    file gone, a stream's lost connection) is raised as ``kept(error)`` returns it: the runner's
    saves the steps trained before it (``Resumable._saved_on_give_up``). Nothing of the step that
    drew it has run, so the weights are those of the last step trained. An error inside a step
    is not saved so: it may be a guard of the user's against weights gone bad (a non-finite loss
    raised in ``loss_fn``), and a save would write over the last good checkpoint with them."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - raised as itself, a note added where steps were saved
            raise kept(exc)
        yield batch


def every_rank_has(parallel: Any, has: bool, step: int, epoch: int, position: int, *,
                   failure: FailedDraw | None = None) -> None:
    """The sync point before each step (and planning's first draw): every rank says whether it
    drew a batch; where some did and some did not, :class:`UnevenDataError` on every rank.
    ``failure``: this rank's data raised it while drawing (or its ``on_step_end``, a
    :class:`FailedDraw` with ``after``); it raises it, its peers
    :class:`~autobatch.errors.PeerFailedError`."""
    kind = 0 if failure is None else failure.kind()
    rows = parallel.exchange([int(has), position, kind], f"runner step {step}: every rank has a batch")
    _raise_failed(parallel, [row[2] for row in rows], failure, step, f"runner step {step}")
    out = [rank for rank, row in enumerate(rows) if not row[0]]
    if out and len(out) < len(rows):
        still = [rank for rank, row in enumerate(rows) if row[0]]
        raise UnevenDataError(
            f"the ranks' data have different numbers of batches: the data of rank {', '.join(map(str, out))} ran "
            f"out after {rows[out[0]][1]} batches of epoch {epoch + 1} while rank {', '.join(map(str, still))} still "
            f"had one; {_ADVICE}"
        )


def every_rank_returned(parallel: Any, failure: FailedDraw | None, step: int) -> None:
    """The sync point at the end of a distributed ``fit()``, before its last checkpoint: an
    ``on_step_end`` error of the run's last step (``failure``: this rank's, not raised yet; no
    next step carries it) raises on every rank, its own there, a
    :class:`~autobatch.errors.PeerFailedError` on its peers."""
    kind = 0 if failure is None else failure.kind()
    rows = parallel.exchange([kind], "runner: every rank's on_step_end returned")
    _raise_failed(parallel, [row[0] for row in rows], failure, step, "runner: the run's end")


def _raise_failed(parallel: Any, kinds: list[int], failure: FailedDraw | None, step: int, label: str) -> None:
    """After a sync point that carried every rank's ``kinds`` (0: none failed): where some rank
    failed, this rank raises ``failure.error`` (its own) or a ``PeerFailedError`` naming each
    failed rank, where and what it raised (told in two more sync points, only then)."""
    failed = [rank for rank, kind in enumerate(kinds) if kind]
    if not failed:
        return
    mine = b"" if failure is None else failure.told(step).encode("utf-8", "replace")
    texts = parallel.exchange_bytes(mine, f"{label}: what failed")
    if failure is not None:
        raise failure.error
    told = "; ".join(f"{'the data' if kinds[rank] == 1 else 'the on_step_end'} of rank {rank} raised an error "
                     f"{texts[rank].decode('utf-8', 'replace')}" for rank in failed)
    raise PeerFailedError(f"{told} (see that rank's log); rank {parallel.rank()} stops too instead of waiting for it", failed)
