"""Batches of any size built from the samples of one: the planner's, the runner's and a probe's.

A probe trial needs a batch of every size it tries; the runner plans on its first global
batch, and a trial larger than it goes round it again. :func:`map_samples` applies one function
to every batched tensor and another to every list of per-sample values (file names, raw text),
keeping the batch's structure; :func:`take_samples` picks given samples, and
:func:`cycle_samples` the first ``n`` round and round by slicing, which fake tensors can trace
(the ``estimate`` strategy builds its batches under them, and they cannot read an index back).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

__all__ = ["cycle_samples", "map_samples", "take_samples"]


def take_samples(batch: Any, index: torch.Tensor, total: int) -> Any:
    """The samples ``index`` of ``batch`` (of ``total`` samples): tensors and per-sample lists
    alike (:func:`map_samples`); a planner's or a probe's batch of any size built from one.
    The index is read back to the host only for a list of per-sample values (a fake index
    cannot be; tensors are picked with ``index_select``)."""
    picks: list[int] = []

    def values(found: Any) -> Any:
        if not picks:
            picks.extend(index.tolist())
        return type(found)(found[i] for i in picks)

    return map_samples(batch, lambda t: t.index_select(0, index.to(t.device)), values, total)


def cycle_samples(batch: Any, size: int, total: int) -> Any:
    """The first ``size`` samples of ``batch`` (of ``total`` samples), round it again past its
    end: sample ``i`` is sample ``i % total``, as ``take_samples(batch, torch.arange(size) %
    total, total)``, but cut and concatenated (a new tensor, as ``index_select`` gives), with no
    index tensor, so it builds the same batch under fake tensors, per-sample lists included."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer (the samples to take), got {size!r}")
    rounds, rest = divmod(size, total)

    def tensors(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor] * rounds + ([tensor.narrow(0, 0, rest)] if rest else []))

    return map_samples(batch, tensors, lambda found: type(found)(list(found) * rounds + list(found[:rest])), total)


def map_samples(batch: Any, tensors: Callable[[torch.Tensor], torch.Tensor], values: Callable[[Any], Any],
                total: int) -> Any:
    """``batch`` (of ``total`` samples) with ``tensors`` applied to each tensor with a batch
    dimension and ``values`` to each list or tuple of per-sample values (as long as the batch,
    holding no tensor, mapping, list or tuple: label names, file names, raw text), keeping its
    structure; other leaves and 0-dim tensors are kept as they are."""
    if isinstance(batch, torch.Tensor):
        return tensors(batch) if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        items = {key: map_samples(value, tensors, values, total) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that cannot be built from a dict (defaultdict)
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_samples(value, tensors, values, total) for value in batch))
    if isinstance(batch, (tuple, list)):
        if batch and len(batch) == total and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch):
            return values(batch)  # one value per sample
        return type(batch)(map_samples(value, tensors, values, total) for value in batch)
    return batch
