"""The data's size as the runner checks it: empty data, and a mid-epoch resume on data of another size.

A resume inside an epoch (or a second ``fit()`` after one stopped inside it) replays the epoch's
start and skips the batches the checkpoint trained (:func:`~autobatch.training.epochs.replayed`).
Those are the samples trained only where the data is the one the interrupted run read. With
samples appended or filtered out, a shuffled loader draws another permutation (``randperm`` of
another length) and a sequential one shifts its indices past a filtered sample, so the batches
skipped are other samples than those trained: measured, a shuffled 22-sample data set grown to
23 or 26, or filtered to 18, before a resume 12 samples into its epoch trained 3 to 7 samples
twice and as many not at all, without a word. The checkpoint now holds the data's size
(:func:`data_size`), and such a resume is one ``ValueError`` (:func:`check_same_size`) naming
both sizes and how to go on. Data without a length (a streaming ``IterableDataset`` without
``__len__``, a generator) cannot be checked so; an epoch's start (position 0) needs no check: a
new epoch on new data skips nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch.utils.data as torch_data

__all__ = ["check_same_size", "data_size", "no_batches", "saved_size", "unbatched_note"]


def _length(value: Any) -> int | None:
    """``len(value)``, or None where it has none (an ``IterableDataset`` without ``__len__``)."""
    try:
        return int(len(value))
    except (TypeError, NotImplementedError):
        return None


def data_size(data: Iterable[Any]) -> dict[str, int | None] | None:
    """What a checkpoint records of ``data``'s size: its ``batches`` (``len(data)``) and, for a
    ``DataLoader``, its dataset's ``samples``; None where neither is known."""
    size = {"batches": _length(data), "samples": _length(getattr(data, "dataset", None))}
    return size if any(value is not None for value in size.values()) else None


def unbatched_note(data: Iterable[Any], share: int) -> str | None:
    """A note for an error reading a batch's size where ``data`` is a ``DataLoader(batch_size=None)``
    of an ``IterableDataset``: its items are taken as whole batches (a stream of ready batches trains
    so), and one yielding single samples failed at its first item with "batch tensors disagree on
    dim 0 ... batch[0] has 4, batch[1] has 1" (a sample's features and its label), naming neither
    the loader nor ``batch_size``. A map-style ``Dataset`` is refused before any step
    (:func:`~autobatch.training.inputs.check_unbatched_loader`); a stream cannot be read ahead."""
    if (not isinstance(data, torch_data.DataLoader) or data.batch_size is not None or data.batch_sampler is not None
            or not isinstance(data.dataset, torch_data.IterableDataset)):
        return None
    return (f"data is a DataLoader(batch_size=None) of the IterableDataset {type(data.dataset).__name__}, whose items "
            f"are taken as whole batches: if it yields single samples, batch them, DataLoader(dataset, "
            f"batch_size={share})")


def saved_size(state: dict[str, Any], global_batch: int) -> dict[str, Any] | None:
    """The checkpoint ``state``'s data size, to check a resume's data against: its ``batches``
    only where this run's ``global_batch`` is the checkpoint's (a loader rebuilt for another one
    has as many samples in other batches); None in checkpoints of earlier versions."""
    saved = state.get("data_size")
    if not saved or state.get("global_batch") == global_batch:
        return saved
    return {**saved, "batches": None}


def check_same_size(saved: dict[str, Any] | None, data: Iterable[Any], epoch: int, position: int) -> dict[str, int | None] | None:
    """``data``'s size (:func:`data_size`), after checking it is the ``saved`` one of the run
    that stopped ``position`` batches into ``epoch``: else one ``ValueError`` saying the data
    changed, that the resume would train some samples twice and others not at all, and how to
    go on. No check at an epoch's start (``position`` 0), nor where either size is unknown."""
    size = data_size(data)
    if not saved or size is None or position <= 0:
        return size
    changed = [key for key in ("samples", "batches") if saved.get(key) is not None and size[key] is not None
               and saved[key] != size[key]]
    if not changed:
        return size
    key = changed[0]
    raise ValueError(
        f"resume: the run stopped {position} batches into epoch {epoch + 1} of data holding {saved[key]} {key}; this "
        f"data holds {size[key]}: samples were added or removed. The resume skips the epoch's first {position} batches "
        "as the trained ones, which in data of another size are other samples: some would train twice, others not at "
        f"all. Finish epoch {epoch + 1} on the data it was trained on (fit(data, epochs={epoch + 1}, resume=...)), then "
        "go on with the new data from the next epoch's start (fit(new_data, epochs=..., resume=...)); or put the data "
        "back as it was"
    )


_used_up = (" or used up: it yielded batches before, so its __iter__ may hand out one iterator (a generator or file "
            "opened in __init__) that a second pass finds exhausted; open it inside __iter__")


def no_batches(data: Iterable[Any], epoch: int) -> ValueError:
    """Why epoch ``epoch`` yielded no batch: ``data`` is empty (a filtered set, a loader whose
    ``drop_last`` dropped its one short batch, a stream that yields nothing), or a one-shot
    iterator was used up. A ``DataLoader`` of an ``IterableDataset`` without ``__len__`` that
    yielded nothing failed here with ``TypeError: object of type ... has no len()``, naming neither
    the data nor the epoch, and is no one-shot iterator: it is named as empty."""
    if _length(data) == 0 or not isinstance(data, Iterator):
        return ValueError(f"data yielded no batches in epoch {epoch + 1}: it is empty (len(data) == 0; a "
                          "DataLoader with drop_last=True over fewer samples than one batch has none; an "
                          "IterableDataset that yields no samples)" + (_used_up if epoch > 0 else "") +
                          "; pass data that holds at least one batch")
    return ValueError(f"data yielded no batches in epoch {epoch + 1}: a generator or other one-shot iterator "
                      "is used up after one pass; pass a re-iterable (a list, a DataLoader), or epochs=1 / steps "
                      "no more than its batches")
