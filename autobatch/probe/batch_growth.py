"""Whether ``make_batch`` still builds more samples at the size a probe answers.

A ``make_batch`` that slices a fixed dataset (``lambda n: (X[:n], y[:n])``) stops growing at the
dataset's size: every trial above it runs the same batch, none runs out of memory, and the
search climbed to :data:`~autobatch.probe.arguments.SEARCH_CEILING` (or ``max_batch``) and
answered a size never trained. The argument checks catch a ``make_batch`` that ignores its size
from the start (:func:`~autobatch.probe.arguments.checked_batches`); :func:`check_batch_grows`
catches one that stops, at the answer, where no out-of-memory error bounded it. It compares the
answer's batch with the batch at half of it, both built with fake tensors (no memory): a batch
padded to a multiple of its size (8, 64) or to a power of two never builds the same batch at
``n`` and ``2n`` once ``n`` is :data:`~autobatch.probe.arguments.CHECK_SIZE` or more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .caching.key_batches import sample_batches

__all__ = ["check_batch_grows", "batch_shapes", "shapes_summary"]

#: the smallest half-size compared: below it, a batch padded to a multiple of 8 or 64 samples
#: may build the same batch at ``n`` and ``2n`` (``arguments.CHECK_SIZE``, repeated to avoid a cycle)
SMALLEST_HALF = 64


def check_batch_grows(make_batch: Any, batch_size: int, why: str) -> None:
    """Raise ``ValueError`` where ``make_batch(batch_size)`` builds the same batch as
    ``make_batch(batch_size // 2)``: ``batch_size`` (``why``: the probe's answer, or the
    estimate's bound) was then never run with that many samples. Nothing is checked below
    ``2 * SMALLEST_HALF`` samples, or where fake tensors cannot build the batches (building
    them for real at the answer's size could take more memory than a trial had)."""
    half = batch_size // 2
    if make_batch is None or half < SMALLEST_HALF:
        return
    batches = sample_batches(make_batch, (half, batch_size), real=False)
    if batches is None:
        return
    shapes = batch_shapes(batches[1])
    if shapes != batch_shapes(batches[0]):
        return
    raise ValueError(
        f"make_batch stops growing: make_batch({batch_size}) built the same batch as make_batch({half}) "
        f"({shapes_summary(shapes)}), so {why}, {batch_size}, holds no more samples than {half}, and no size above "
        f"{half} could run out of memory; make_batch(n) must build n samples at every size. A slice of a fixed "
        "dataset (X[:n]) stops at the dataset's size: repeat its samples (X[torch.arange(n) % len(X)]), or pass "
        "max_batch=len(X) to search no higher"
    )


def batch_shapes(batch: Any, depth: int = 0) -> Any:
    """What of ``batch`` grows with its size: tensors' shapes, containers' items (and lengths),
    plain values, objects' public attributes."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape))
    if batch is None or isinstance(batch, (bool, int, float, str, bytes)):
        return batch
    if depth > 8:
        return type(batch).__name__
    if isinstance(batch, Mapping):
        return {repr(key): batch_shapes(item, depth + 1) for key, item in list(batch.items())[:64]}, len(batch)
    if isinstance(batch, (list, tuple)):
        return [batch_shapes(item, depth + 1) for item in batch[:64]], len(batch)
    attributes = getattr(batch, "__dict__", None)
    if isinstance(attributes, dict):
        return type(batch).__name__, {k: batch_shapes(v, depth + 1) for k, v in attributes.items() if not k.startswith("_")}
    return type(batch).__name__, getattr(batch, "shape", None), getattr(batch, "__len__", lambda: None)()


def shapes_summary(shapes: Any) -> str:
    """The tensors' shapes in :func:`batch_shapes`' description, for a message."""
    found: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "tensor":
            found.append(str(tuple(value[1])))
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)

    collect(shapes)
    if not found:
        return f"{str(shapes):.80}"
    return f"tensors of shapes {', '.join(found[:6])}{', ...' if len(found) > 6 else ''}"
