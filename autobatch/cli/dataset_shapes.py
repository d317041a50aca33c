"""A ``data.dataset`` whose samples differ in shape (variable-length sequences), refused in one line.

The command line batches a ``_target_`` dataset's samples with torch's ``default_collate`` (the probe's
:class:`~autobatch.workloads.batches.DatasetBatches`, the training ``DataLoader``), which stacks them
only at one shape, and it has no collate key. Such a dataset failed in the probe's first trial, or
training's first batch, on torch's "stack expects each tensor to be equal size, but got [14] at entry 0
and [21] at entry 1", after a warning that the probe cache was off, naming neither the dataset nor what
to change. And had a batch collated (a dataset sorted by length, unshuffled), the probe would have sized
the batch from the first samples, not the longest, as the Lightning and Transformers integrations do
(:mod:`autobatch.integrations.transformers_samples`). :func:`check_sample_shapes` reads a few samples
spread over the dataset, as :mod:`autobatch.integrations.lightning_longest` peeks, before the probe.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from ..planning.samples import spread_indices

__all__ = ["PEEK", "check_sample_shapes"]

#: samples read, spread evenly over the dataset (its first and last among them)
PEEK = 8


def _shape(value: Any) -> tuple[int, ...] | None:
    """A tensor's or array's shape, a list's length; None for what default_collate does not stack."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(shape)
    return (len(value),) if isinstance(value, list) else None


def check_sample_shapes(cfg: DictConfig, dataset: Any) -> None:
    """:data:`PEEK` samples spread over ``dataset`` ((input, target) pairs, as checked before) whose
    inputs or targets differ in shape from the first sample's: one error naming both and the change."""
    length = len(dataset)
    if length < 2:
        return
    indices = spread_indices(length, PEEK)
    first = dataset[indices[0]]
    for index in indices[1:]:
        sample = dataset[index]
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
            return  # a sample of another form: default_collate's own error names it
        for field, given, other in (("input", first[0], sample[0]), ("target", first[1], sample[1])):
            shape, differs = _shape(given), _shape(other)
            if shape is None or differs is None or shape == differs:
                continue
            raise ValueError(
                f"data.dataset={cfg.data.dataset.get('_target_')}: its samples' {field}s differ in shape "
                f"(data.dataset[0]'s {list(shape)}, data.dataset[{index}]'s {list(differs)}): the command line "
                "batches samples with torch's default collate, which stacks them only at one shape, and has no "
                f"collate key; return {field}s of one shape from __getitem__ (pad or crop each to one length: the "
                "longest, so that the probe sizes the batch the longest samples make), or train it in Python "
                "with autobatch.Runner and a DataLoader with your collate_fn (docs/runner.md)"
            )
