"""What :func:`~autobatch.integrations.transformers.fit_batch_size` tells of the padding of the
batches it probed (:func:`padding_note`): the main input's length in them, as the data collator
padded it, and the lengths of the samples it came from.

Why: the probe puts the training set's shortest sample beside its longest in each batch, so the
collator pads it as it pads ``train()``'s batches (:func:`~.transformers_samples.probe_samples`);
the INFO line named the size and nothing said which length was probed, or whether the batches
were padded at all (a set of one length, a ``sample=`` given, a collator padding to a multiple).
Only a main input whose sample is a flat sequence (token ids, an audio's values) has a length to
tell: images and other inputs get no note.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["note_padding", "padded_length", "padding_note", "sample_length"]


def padded_length(batch: Any, main: str) -> int | None:
    """The length of ``main`` in a collated ``batch`` (its second dimension, a 2-D tensor's, fake or
    real), or None where the batch holds no such tensor."""
    value = batch.get(main) if isinstance(batch, Mapping) else batch
    return int(value.shape[1]) if isinstance(value, torch.Tensor) and value.dim() == 2 else None


def sample_length(sample: Any, main: str) -> int | None:
    """The length of a sample's ``main`` field (a lone sample: itself) where it is a flat sequence:
    a list of numbers, a 1-D tensor or array; None otherwise (an image, text the collator tokenizes)."""
    value = sample.get(main) if isinstance(sample, Mapping) else None if isinstance(sample, tuple) else sample
    if isinstance(value, torch.Tensor) or hasattr(value, "ndim"):
        return int(len(value)) if getattr(value, "ndim", None) == 1 else None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return len(value) if all(isinstance(item, numbers.Number) for item in value[:1]) else None
    return None


def padding_note(main: str, padded: int | None, longest: Any, short: Any, compared: bool | None) -> str | None:
    """What the probed batches held of ``main``: ``padded`` (:func:`padded_length` of a probed
    batch, None if unread), the ``longest`` sample's length and the ``short`` one's beside it;
    ``compared``: None where ``longest`` is the ``sample=`` given, False where the training set's
    samples could not be compared (the first was probed). None where ``main`` has no length."""
    length = sample_length(longest, main)
    if length is None:
        return None
    shortest = None if short is None else sample_length(short, main)
    if shortest is not None:
        why = f"the training set's longest sample has {length}, its shortest {shortest}, in each probed batch"
    elif compared is None:
        why = f"the sample= given has {length}, probed alone"
    elif compared:
        why = f"every sample of the training set has {length}" if short is None else f"the longest sample has {length}"
    else:
        why = f"the training set's first sample has {length} (its longest could not be told)"
    if padded is None:  # a collator whose batch holds no 2-D main input: its padding is unknown
        head = main
    elif shortest is None and padded == length:
        head = f"{main} of length {length}, unpadded"
    else:
        head = f"{main} padded to length {padded}"
    return f"{head}: {why}"


def note_padding(result: Any, step: Any, longest: Any, short: Any, compared: bool | None) -> str | None:
    """:func:`padding_note` of a :class:`~.transformers_step.TrainerStep` that was probed (its ``main``
    input and the ``padded`` length it recorded), added to the probe ``result``'s notes where there is
    one, and returned for the INFO line that names the size (with the steps ``train()`` runs)."""
    note = padding_note(step.main, step.padded, longest, short, compared)
    if note is not None:
        result.notes.append(f"fit_batch_size probed batches of {note}")
    return note
