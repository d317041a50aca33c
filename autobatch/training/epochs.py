"""An epoch's batches as the runner takes them, and the replay that puts a resume in its place.

Kept apart from :mod:`autobatch.training.checkpoints.resume` (which saves and loads checkpoints): the epoch's
iterator counts the batches it drew from ``iter(data)``, so a checkpoint can tell a step whose
batch was already drawn (an interrupt inside it) from one that was not (a checkpoint between
steps, an epoch's end), and :func:`replayed` rebuilds the iterator a resumed run continues:
made under the epoch's start random state, past the batches already drawn, the saved global
random state put back after them (the loader's own generators stay where the replay left them).
A ``DataLoader`` draws from its generators at ``iter()`` (the workers' base seed) and at the
first batch (a shuffle's permutation), and a dataset may draw
augmentation in ``__getitem__``: a resume that made the iterator afresh from the random state of
an interrupted first step, which had drawn all that already, trained another order.

The batches are drawn in host memory (:class:`HostDraws`): on the CPU's simulated device no budget
counts what ``data`` builds, as a GPU's never counts the host's batches; moving each micro-batch
to the device is what takes device memory, as a probe's trial makes its one batch there.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable, Iterator

import torch

from ..memory.simulated import host_memory
from ..planning.accumulation import batch_size_of
from ..planning.dataclass_batches import same_values
from .checkpoints.checkpoint_io import rng_state, set_rng_state

__all__ = ["EpochBatches", "HostDraws", "epoch_length", "replayed", "set_epoch", "started"]

log = logging.getLogger("autobatch")


class EpochBatches:
    """An epoch's iterator over ``iter(data)``, counting the batches drawn from it (``drawn``).

    The runner may run it to its end right after the last batch (``len(data)``) trained, before
    a checkpoint (:meth:`end`): a ``DataLoader(generator=...)``'s ``RandomSampler`` draws once
    more from its generator only then, and a checkpoint written after that draw is one of the
    next epoch's start (position 0), resumed with any global batch, in the uninterrupted run's
    order, without iterating the finished epoch again. Batches drawn but not yet yielded (one
    beyond ``len(data)`` that :meth:`end` took; those a resume drew while replaying) are yielded
    first."""

    def __init__(self, batches: Iterator[Any], epoch: int, *, drawn: int = 0, ahead: list[Any] | None = None,
                 data: Any = None) -> None:
        self._batches = batches
        self.epoch = epoch  # the runner's epoch this iterator is of
        self.drawn = drawn  # batches drawn from ``iter(data)`` in this epoch, skipped ones included
        self._ahead: list[Any] = list(reversed(ahead or []))  # drawn, not yet yielded (popped from the end)
        self.ended = False
        # ``data`` where it is a one-shot iterator (a generator): a later fit() on it goes on with this
        # iterator (:meth:`continues`); its last batch is kept, which a step stopped part-way had drawn
        self.one_shot = data if isinstance(data, Iterator) else None
        self.last: Any = None

    def __iter__(self) -> "EpochBatches":
        return self

    def __next__(self) -> Any:
        if self._ahead:
            batch = self._ahead.pop()
        elif self.ended:
            raise StopIteration
        else:
            batch = next(self._batches)
            self.drawn += 1
        if self.one_shot is not None:
            self.last = batch
        return batch

    def continues(self, data: Any, epoch: int, fetched: bool) -> bool:
        """Whether a later ``fit(data)`` of epoch ``epoch`` goes on with this iterator: ``data`` is
        the one-shot iterator it reads. Replaying the epoch's start is for data that iterate
        afresh (a list, a DataLoader, a checkpoint's resume): on a generator it skipped, untrained,
        as many batches as were trained. ``fetched``: the step at the runner's position had drawn
        its batch (stopped part-way), which is yielded first again."""
        if self.one_shot is None or self.one_shot is not data or self.epoch != epoch:
            return False
        if fetched and not self._ahead and self.last is not None:
            self._ahead.append(self.last)
        return True

    def end(self) -> None:
        """Run the iterator to its end; a batch it still yields (``len(data)`` was short) is kept
        for the loop, and the epoch goes on."""
        if self.ended or self._ahead:
            return
        try:
            batch = next(self._batches)
        except StopIteration:
            self.ended = True
        else:
            self.drawn += 1
            self._ahead.append(batch)


def replayed(data: Iterable[Any], epoch: int, epoch_rng: dict[str, Any], resumed_rng: dict[str, Any],
             generators: list[torch.Generator], position: int, fetched: bool, samples: int | None = None) -> EpochBatches:
    """The epoch's iterator where a resumed (or continued) run goes on: ``iter(data)`` made under
    the epoch's start random state ``epoch_rng``, the ``position`` batches already trained drawn
    and dropped, the batch at ``position`` drawn too where the interrupted run had drawn it
    (``fetched``: a step stopped part-way) and kept to be yielded first, then ``resumed_rng``
    (the checkpoint's) put back: the loader's draws at ``iter()`` and at each batch, the
    interrupted run's, are not drawn a second time from the saved state.

    ``samples``: those the checkpoint trained in this epoch (one process; None: not checked). The
    batches skipped must hold them: a run resumed with another ``global_batch`` counts its
    position in batches of the new size, and a loader still built with the old ``batch_size``
    skipped that many of its larger batches (resumed from 16 samples into a 22-sample epoch with
    ``global_batch=2`` over batches of 4, it skipped all 22, with two warnings naming neither the
    loader nor the samples lost); one ``ValueError`` naming the batch size to build it with instead.

    Of ``resumed_rng`` only the global generators are put back; the loader's own (``generators``)
    stay where the replay left them, having drawn what this iterator draws. Workers read ahead
    (``prefetch_factor`` batches each), and a ``RandomSampler`` draws its last permutation from
    its generator when the workers' read-ahead reaches the epoch's end: the checkpoint's state of
    them is where its run's read-ahead stood. Put back under another ``global_batch`` or
    ``num_workers`` (another read-ahead), that last draw was made twice or not at all, and every
    later epoch shuffled another order than the uninterrupted run's. An error the data raise while
    the skipped batches are drawn propagates (the runner carries it to the step's vote under
    ``torch.distributed``), with ``resumed_rng`` put back all the same."""
    set_rng_state(epoch_rng, generators)
    try:
        batches = started(data, epoch, generators)
        sizes = [_samples_in(batch) for batch in itertools.islice(batches, min(position, 1))]
        after_first = rng_state()  # the global generators once the epoch's first batch is drawn
        sizes += [_samples_in(batch) for batch in itertools.islice(batches, position - len(sizes))]
        skipped = len(sizes)
        if samples is not None and position > 0 and None not in sizes and sum(sizes) != samples:  # type: ignore[arg-type]
            raise ValueError(_other_batches(epoch, position, samples, sizes))
        if skipped < position:
            log.warning("resume: the epoch has only %d batches, the checkpoint is at %d", skipped, position)
        ahead = list(itertools.islice(batches, 1)) if fetched and skipped == position else []
        if position > 0 and _order_drawn_here(data):
            _warn_interleaved_draws(epoch, position, after_first, rng_state(), resumed_rng)
    finally:  # also where the data raised drawing a skipped batch: the run's random state, not the replay's
        set_rng_state({key: value for key, value in resumed_rng.items() if key != "data"})
    return EpochBatches(batches, epoch, drawn=skipped + len(ahead), ahead=ahead, data=data)


def _order_drawn_here(data: Iterable[Any]) -> bool:
    """Whether ``data`` may draw which samples come next in this process, batch by batch: an
    ``IterableDataset``'s ``DataLoader`` without workers, or an iterable that is no ``DataLoader``
    (a map-style dataset's order is its sampler's, drawn at the epoch's first batch, and what its
    ``__getitem__`` draws, augmentation, picks no sample)."""
    if isinstance(data, torch.utils.data.DataLoader):
        return isinstance(data.dataset, torch.utils.data.IterableDataset) and not data.num_workers
    return True


def _same_global(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two :func:`rng_state` values hold the same CPU torch, Python and NumPy generators."""
    return all(same_values(one.get(key), other.get(key)) for key in ("torch", "python", "numpy"))


def _warn_interleaved_draws(epoch: int, position: int, after_first: dict[str, Any], replayed_to: dict[str, Any],
                            saved: dict[str, Any]) -> None:
    """Warn where the replay cannot have drawn the interrupted run's batches: drawing them after the
    epoch's first moved the global generators, and the replay, which draws them with no step in
    between, ends elsewhere than the checkpoint's state, so the run's steps drew from them too
    (dropout) between its batches. A shuffle buffer drawing from torch's generator in an
    ``IterableDataset``'s ``__iter__`` (no workers) then picked other samples: resumed 3 batches into
    a 24-sample epoch, the rest of it trained 3 samples twice and 3 not at all, without a word.
    A data set that draws nothing after its first batch (a whole-epoch shuffle in ``__iter__``), or
    a run whose steps draw nothing, replays exactly and is not warned."""
    if _same_global(after_first, replayed_to) or _same_global(replayed_to, saved):
        return
    log.warning(
        "resume: the data drew from the global random generators (torch's, Python's or NumPy's) while its batches "
        "were drawn, between the interrupted run's steps, which drew from them too (dropout); the resume skips the "
        "%d batches trained in epoch %d without those steps' draws, so where the data draws which samples come next "
        "(a shuffle buffer in an IterableDataset's __iter__) the rest of the epoch may train some samples twice and "
        "others not at all. For an exact resume draw the order from a generator the dataset holds "
        "(self.generator = torch.Generator(), which checkpoints save) or seeds by the epoch (set_epoch)",
        position, epoch + 1,
    )


def _samples_in(batch: Any) -> int | None:
    """A skipped batch's samples, as the runner counted them when it trained it (None: unreadable)."""
    try:
        return batch_size_of(batch)
    except (TypeError, ValueError):
        return None


def _other_batches(epoch: int, position: int, samples: int, sizes: list[int]) -> str:
    """Why a replay's skipped batches are not the checkpoint's samples (:func:`replayed`)."""
    shown = ", ".join(map(str, sizes[:4])) + (", ..." if len(sizes) > 4 else "")
    return (f"resume: the checkpoint trained {samples} samples of epoch {epoch + 1}, {position} batches of this run's "
            f"global_batch, but the data's first {len(sizes)} batches hold {sum(sizes)} ({shown}): they are not the "
            f"batches the run counts, and the resume would {'repeat' if sum(sizes) < samples else 'skip'} samples. "
            "Build the data with batch_size=global_batch (per rank), as the interrupted run's was built with its "
            "own, or resume with the checkpoint's global_batch")


def started(data: Iterable[Any], epoch: int, generators: list[torch.Generator]) -> Iterator[Any]:
    """``iter(data)``, drawing from the random generators what the uninterrupted run drew there.

    A ``DataLoader(persistent_workers=True, num_workers>0)`` makes its iterator once, in the
    first epoch (its workers' base seed drawn from its generator, then the shuffle's order), and
    later epochs only reset it (the order alone). A resumed process's loader has no iterator yet:
    made afresh at a later epoch, it drew the base seed first and shuffled another order than the
    uninterrupted run, so part of the epoch's samples trained twice and others not at all. There
    it is first made and the random state put back, so ``iter(data)`` resets it as that run did
    (the workers' own random numbers still differ: ``warn_persistent_workers``)."""
    persistent = getattr(data, "persistent_workers", False) and (getattr(data, "num_workers", 0) or 0) > 0
    with host_memory():
        if epoch > 0 and persistent and isinstance(data, torch.utils.data.DataLoader) and data._iterator is None:
            state = rng_state(generators)
            iter(data)  # the workers, and the first epoch's draws, thrown away
            set_rng_state(state, generators)
        return HostDraws(iter(data))


class HostDraws:
    """``iterator``'s items drawn in host memory (:func:`~autobatch.memory.simulated.host_memory`).

    Under :func:`~autobatch.simulated_memory` a ``DataLoader``'s collated batch was counted on
    the simulated device, and moving it there made no copy (it was counted already): the whole
    global batch, every micro-batch's inputs, stayed alive through every backward, where a probe's
    trial holds one micro-batch's until its forward returns. At the answer (2322 for a small MLP
    under 1 MiB) the runner's first step ran out of memory and recovered at 2075. One draw per
    ``next``, as the iterator's own (an error in one leaves it as it was)."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator

    def __iter__(self) -> "HostDraws":
        return self

    def __next__(self) -> Any:
        with host_memory():
            return next(self._iterator)


def set_epoch(data: Iterable[Any], epoch: int) -> None:
    """``set_epoch(epoch)`` on ``data``'s sampler, batch sampler and dataset (a DataLoader's) or on
    ``data`` itself, where they have it: a ``DistributedSampler`` shuffles by it, and drew the
    same order every epoch without it; so does an ``IterableDataset`` that shuffles by its epoch
    (Hugging Face ``datasets``' ``IterableDataset.shuffle()``: Transformers' ``Trainer`` calls it),
    which drew the same order every epoch too."""
    seen = set()
    dataset = getattr(data, "dataset", None)
    for holder in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None),
                   getattr(getattr(data, "batch_sampler", None), "sampler", None), dataset):
        method = getattr(holder, "set_epoch", None)
        if callable(method) and id(holder) not in seen:
            seen.add(id(holder))
            before = dict(getattr(holder, "__dict__", {})) if holder is dataset and epoch > 0 else None
            method(epoch)
            if before is not None:
                _warn_unreached_epoch(data, holder, epoch, before)


def _warn_unreached_epoch(data: Any, dataset: Any, epoch: int, before: dict[str, Any]) -> None:
    """Warn, once per loader, where ``set_epoch`` on a ``DataLoader(persistent_workers=True)``'s
    dataset rebinds attributes (``self.epoch = epoch``): each worker holds the copy of the dataset
    it was started with, in the first epoch, and never sees the new value, so a shuffle or an
    augmentation the dataset draws from its epoch repeated the first epoch's every epoch, without
    a word (an ``IterableDataset`` seeded by its epoch yielded one order all run), and a resumed
    run's new workers, started with the resumed epoch, trained another order than the
    uninterrupted run's (some samples twice, others not at all). An epoch changed in place in
    shared memory (Hugging Face ``datasets``' ``set_epoch``) reaches the workers and is not warned."""
    persistent = getattr(data, "persistent_workers", False) and (getattr(data, "num_workers", 0) or 0) > 0
    if not persistent or getattr(data, "_autobatch_epoch_warned", False):
        return
    after = getattr(dataset, "__dict__", {})
    rebound = sorted(name for name in after if name not in before or after[name] is not before[name])
    if not rebound:
        return
    data._autobatch_epoch_warned = True
    log.warning(
        "set_epoch(%d) on the DataLoader's dataset (%s) sets %s anew, which its persistent workers "
        "(persistent_workers=True) never see: each keeps the copy of the dataset it was started with, so a shuffle "
        "or augmentation drawn from the epoch repeats the first epoch's every epoch, and a resumed run's new workers "
        "draw another epoch's (training some samples twice, others not at all). Keep the epoch in shared memory, "
        "changed in place (self.epoch = torch.zeros((), dtype=torch.long).share_memory_() in __init__, "
        "self.epoch.fill_(epoch) in set_epoch, as Hugging Face datasets does), or use persistent_workers=False",
        epoch, type(dataset).__name__, ", ".join(f"self.{name}" for name in rebound),
    )


def epoch_length(data: Iterable[Any], epochs: int | None) -> int | None:
    """Batches in ``epochs`` passes over ``data`` (None: no length, or no epoch count)."""
    try:
        return len(data) * epochs if epochs is not None else None  # type: ignore[arg-type]
    except TypeError:
        return None
