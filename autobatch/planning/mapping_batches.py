"""A mapping batch rebuilt with its values mapped: a micro-batch's piece, or the batch moved to a device.

:func:`~autobatch.planning.samples.map_samples` (the split) and
:func:`~autobatch.training.batch_ops.map_tensors` (the move to the device) rebuild a mapping batch
as its own type from a dict of its mapped values (a mapping type that cannot be built from a dict,
``defaultdict``, as a dict). A Hugging Face ``BatchEncoding`` from a fast tokenizer holds more than
its dict: one ``tokenizers.Encoding`` per sample (``batch.encodings``), which ``word_ids(i)``,
``token_to_word``, ``char_to_token`` read. Built from the dict alone, every piece, and every move to
the device even of a batch trained in one micro-batch, lost them: a ``loss_fn`` calling
``batch.word_ids(i)`` raised transformers' "word_ids() is not available when using Python based
tokenizers" (review 36). They are passed on: cut with the samples for a piece, whole for a move.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["rebuilt_mapping"]


def rebuilt_mapping(node: Mapping, items: dict, per_sample: Callable[[list], Any] | None = None) -> Any:
    """``node``'s type built from ``items`` (a dict where it cannot be); a ``BatchEncoding``'s
    encodings passed on, through ``per_sample`` (the split's cut of a list of per-sample values,
    ``None`` where the list is not one per sample) where given."""
    encodings = getattr(node, "_encodings", None)
    if encodings is not None and hasattr(node, "n_sequences"):  # a fast tokenizer's BatchEncoding
        return type(node)(items, encoding=encodings if per_sample is None else per_sample(list(encodings)),
                          n_sequences=node.n_sequences)
    try:
        return type(node)(items)
    except TypeError:  # a mapping type that cannot be built from a dict (defaultdict)
        return items
