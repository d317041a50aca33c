"""The worst-case sample :func:`~autobatch.integrations.transformers.fit_batch_size` probes at:
:func:`longest_sample`, each field of the training set at its longest (by its padded size), read
once (a columnar 🤗 ``datasets.Dataset`` a thousand rows a slice; a stream's first
:data:`STREAM_SAMPLES`). Split from :mod:`.transformers` (which re-exports it) to keep each
module readable; it needs no framework."""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch

__all__ = ["SLICE_ROWS", "STREAM_SAMPLES", "longest_sample", "probe_samples", "refuse_batched_sample", "scan_samples"]

log = logging.getLogger("autobatch")


#: samples read from a training set without a length (a stream) in search of the longest
STREAM_SAMPLES = 1000
#: rows a columnar dataset's slice reads at a time (:func:`_rows_by_slice`)
SLICE_ROWS = 1000


def longest_sample(dataset: Any) -> Any:
    """The worst-case sample: each field at its longest over the training set, as a padded
    batch can meet them. A collator pads every field to its own longest in the batch, so a
    batch may pair one sample's long source with another's long target (seq2seq): the probe's
    sample takes each field from wherever it is longest, measured by its padded size (a
    multiple-choice sample's choices count as choices x their longest). Fields of the same
    length in every sample (token ids and their attention mask) stay the same length.

    A sample is a record of fields when it is a mapping (by key) or a tuple (by position); any
    other sample (a list of token ids, a tensor) is one field, and the largest one is kept.
    Text counts its characters, for a collator that tokenizes it (a chat: messages x the longest).
    Where the samples cannot be compared (a tuple's or a lone sample's image or other object,
    samples of different structures), this warns and returns the first: pass ``sample=`` (your
    longest) then. A mapping's field of such a kind is taken from the first sample.

    A map-style dataset is read by index over its length, once (a columnar one, such as a 🤗
    ``datasets.Dataset``, a thousand rows a slice). A dataset without a length
    (an ``IterableDataset``, maybe endless) is read for its first :data:`STREAM_SAMPLES`
    samples only, with a warning: pass ``sample=`` to probe at the longest one yourself, and
    always for a stream that cannot be read twice (the samples read here would be gone when
    ``train()`` reads it)."""
    return probe_samples(dataset)[0]


def probe_samples(dataset: Any) -> tuple[Any, Any]:
    """``(longest, short)``: :func:`longest_sample`, and, where a field's padded size varies over
    the training set, its shortest sample (the least padded size over its fields), else None.
    The probe puts ``short`` in each batch beside the longest so the collator pads it as it pads
    ``train()``'s batches: a batch of one length has an attention mask of ones, which a BERT's
    attention drops, where a padded batch builds a mask of batch x heads x length x length; a
    frozen BERT (classifier head trained) probed without padding answered 84 and ``train()`` at
    84 ran out of memory in that mask. A training set of one length (packed text) has none."""
    longest, short, _ = scan_samples(dataset)
    return longest, short


def scan_samples(dataset: Any, warn: bool = True) -> tuple[Any, Any, bool]:
    """:func:`probe_samples`'s ``(longest, short)``, and whether the samples could be compared (False:
    this warned, and ``longest`` is the first sample), so that the log can say which a ``short`` of
    None is: a set of one length, or one whose longest sample could not be told. ``warn=False``: no
    warning where they cannot be compared (Lightning's callback then probes the loader's first batch)."""
    items = _samples(dataset)
    first = next(items, _EMPTY)
    if first is _EMPTY:
        raise ValueError("fit_batch_size: the training set is empty")
    best: dict[Any, Any] = {}
    sizes: dict[Any, int] = {}
    short, least = None, None
    for index, item in enumerate(itertools.chain([first], items)):
        fields = _fields(item, first)
        if isinstance(fields, str):
            if not warn:
                return first, None, False
            log.warning("fit_batch_size: cannot tell the longest sample of the training set (sample %d: %s); probing "
                        "at the first sample, which a longer one may not fit beside; pass sample= (your longest "
                        "sample, as the dataset yields it)", index, fields)
            return first, None, False
        total = 0
        for key, value in fields:
            size = _padded_size(value)
            total += size
            if size > sizes.get(key, -1):
                best[key], sizes[key] = value, size
        if least is None or total < least:
            short, least = item, total
    # a sample below the longest's total is shorter in some field: batches of the set are padded
    return _rebuilt(first, best), (short if least is not None and least < sum(sizes.values()) else None), True


_EMPTY = object()


def refuse_batched_sample(sample: Any, dataset: Any) -> None:
    """One ``ValueError`` where ``sample=`` is a batch of one, not a sample as ``dataset`` yields it: a
    field with one leading dimension of 1 more than the training set's first sample has
    (``tokenizer(text, return_tensors="pt")``, shape ``(1, 60)`` where the set holds lists of 60). The
    collator stacked it into ``(batch, 1, 60)``, and the probe's first trial failed inside the model
    (a BERT: "too many values to unpack (expected 2)"), naming neither ``sample=`` nor the fix. Only a
    mapping beside a map-style training set is compared (its first sample, read by index)."""
    if not isinstance(sample, Mapping) or not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__") \
            or len(dataset) == 0:
        return
    first = dataset[0]
    if not isinstance(first, Mapping):
        return
    for key, value in sample.items():
        given, held = _dims(value), _dims(first.get(key))
        if given is not None and held is not None and given == held + 1 and _leading(value) == 1:
            raise ValueError(
                f"fit_batch_size: sample= is a batch of one, not a sample as the training set yields it: its {key!r} "
                f"has {given} dimensions (the first of size 1) where the training set's have {held}; pass one sample "
                f"(tokenize without return_tensors='pt', or {{k: v[0] for k, v in sample.items()}})")


def _dims(value: Any) -> int | None:
    """Dimensions of a tensor, array or nested list of numbers (None: text, or not such a value)."""
    if isinstance(value, torch.Tensor) or _is_array(value):
        return int(value.ndim)
    if isinstance(value, numbers.Number):
        return 0
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        inner = _dims(value[0]) if value else 0
        return None if inner is None else inner + 1
    return None


def _leading(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) or _is_array(value) else len(value)


def _samples(dataset: Any) -> Iterator[Any]:
    """The samples :func:`longest_sample` reads, a bounded number: a map-style dataset by index
    over its length (iterating one runs ``__getitem__`` until it raises ``IndexError``, which a
    synthetic or wrapping dataset never does); a stream by iteration, up to its length or,
    without one, up to :data:`STREAM_SAMPLES` (with a warning)."""
    try:
        length = len(dataset)
    except TypeError:
        log.warning("fit_batch_size: the training set has no length (a stream); probing at the longest of its first "
                    "%d samples, which this reads; pass sample= (your longest sample) if a later one is longer, and "
                    "always for a stream that cannot be read twice", STREAM_SAMPLES)
        return itertools.islice(iter(dataset), STREAM_SAMPLES)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return itertools.islice(iter(dataset), length)
    if length and isinstance(getattr(dataset, "column_names", None), list):
        return _rows_by_slice(dataset, length)
    return (dataset[index] for index in range(length))


def _rows_by_slice(dataset: Any, length: int) -> Iterator[Any]:
    """A columnar dataset's rows (🤗 ``datasets.Dataset``: ``column_names``, and a slice gives a
    mapping of columns), read :data:`SLICE_ROWS` at a time: what ``dataset[i]`` gives, as that
    slice's ``i``-th value of each column. Measured here (CPU, 100,000 tokenized rows,
    ``datasets`` 5.2): :func:`longest_sample` in 1.3 s, where one ``dataset[i]`` a row took 2.7 s.
    Where the first slice is no such mapping of ``dataset[0]``'s fields, row by row."""
    batch = dataset[0:SLICE_ROWS]
    first = dataset[0]
    rows = min(SLICE_ROWS, length)
    if not (isinstance(batch, Mapping) and isinstance(first, Mapping) and list(batch) == list(first)
            and all(isinstance(column, Sized) and len(column) == rows for column in batch.values())):
        yield from (dataset[index] for index in range(length))
        return
    for start in range(0, length, SLICE_ROWS):
        batch = batch if start == 0 else dataset[start:start + SLICE_ROWS]
        keys = list(batch)
        for values in zip(*(batch[key] for key in keys)):
            yield dict(zip(keys, values))


def _fields(item: Any, first: Any) -> list[tuple[Any, Any]] | str:
    """``item``'s ``(key, value)`` fields, shaped as ``first``'s: a mapping's items, a tuple's
    positions, or the whole sample as one field; a string saying why not where ``item`` cannot be
    compared with ``first`` (another structure, or a value with no padded size)."""
    if isinstance(first, Mapping):
        if not isinstance(item, Mapping):
            return f"a {type(item).__name__} among {type(first).__name__} samples"
        return list(item.items())  # a column of another kind (an id object) is the collator's to drop
    if isinstance(first, tuple):
        if not isinstance(item, tuple) or len(item) != len(first):
            return f"a {type(item).__name__} of {_length(item)} among tuples of {len(first)}"
        fields = list(enumerate(item))
    elif isinstance(item, (Mapping, tuple)):
        return f"a {type(item).__name__} among {type(first).__name__} samples"
    else:
        fields = [(None, item)]
    unknown = [value for _, value in fields if not _measurable(value)]
    return f"a {type(unknown[0]).__name__} has no padded size" if unknown else fields


def _length(item: Any) -> str:
    try:
        return str(len(item))
    except TypeError:
        return "no length"


def _rebuilt(first: Any, best: dict[Any, Any]) -> Any:
    """The worst-case sample in ``first``'s structure, from its fields at their longest."""
    if isinstance(first, Mapping):
        return type(first)(best) if type(first) is not dict and _rebuildable(first) else dict(best)
    if isinstance(first, tuple):
        values = [best[index] for index in range(len(first))]
        return type(first)._make(values) if hasattr(type(first), "_make") else tuple(values)
    return best[None]


def _measurable(value: Any) -> bool:
    """Whether :func:`_padded_size` knows what ``value`` takes in a padded batch."""
    return value is None or isinstance(value, (numbers.Number, torch.Tensor, Sequence, Mapping)) or _is_array(value)


def _is_array(value: Any) -> bool:
    """An array of another library (NumPy's): an integer ``ndim`` and element count ``size``."""
    return isinstance(getattr(value, "ndim", None), int) and isinstance(getattr(value, "size", None), int)


def _padded_size(value: Any) -> int:
    """The elements ``value`` takes once padded: a sequence's length, a nested sequence's
    outer length times its longest inner one, a tensor's (or array's) element count; 0 for a
    scalar; text its characters, the best guess at its tokens without the tokenizer (as 0, the
    first sample's text was probed: a short one answered 64, and train() ran out of memory)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):  # a chat message ({"role": ..., "content": ...}): its text together
        return sum(_padded_size(v) for v in value.values())
    if isinstance(value, torch.Tensor):
        return int(value.numel()) if value.dim() else 0
    if _is_array(value):
        return int(value.size) if value.ndim else 0
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if not value or isinstance(value[0], numbers.Number):  # flat (token ids, a mask): no element to look into
            return len(value)
        inner = [_padded_size(v) for v in value if isinstance(v, (Sequence, Mapping, torch.Tensor)) or _is_array(v)]
        return len(value) * max(inner) if inner else len(value)
    return 0


def _rebuildable(record: Mapping[str, Any]) -> bool:
    try:
        type(record)({})
        return True
    except TypeError:
        return False
