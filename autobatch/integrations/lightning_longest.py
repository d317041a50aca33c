"""The batch :class:`~autobatch.integrations.lightning.AutoBatchSize` probes where the train set's samples vary in size.

The probe's trials repeat one batch to each size (:class:`~.lightning_step.LightningStep`). It was the train
dataloader's first batch, so a loader of variable-length samples padded to the longest in the batch (a
``collate_fn`` that pads, ``DataCollatorWithPadding``) was probed at whatever length that batch drew, and
nothing said so. Measured (CPU, simulated 8 MiB, a token model, 2,000 samples of 8-63 tokens, 1 in 100 of
256-512, shuffled): the probe answered 33 on a first batch of short samples, the confirmation stepped down to
18 on the loop's batches, blaming "bytes beyond the probed step", and a batch of the longest samples ran out
of memory at 18. :func:`longest_batch` builds it as ``fit_batch_size`` builds the Transformers probe's
(:func:`~.transformers_samples.scan_samples`): the set's longest sample beside its shortest, collated by the
loader's own ``collate_fn``, so every batch is padded to the longest length the data has, and the answer holds
for the batch holding the longest samples (``train_dataloader()`` sorted longest-first too).

Only a ``DataLoader`` that batches a map-style dataset with its ``batch_size`` (not an iterable dataset, not a
custom batch sampler) is read; :data:`PEEK` samples spread over the set first, and the whole set (once, a
columnar ``datasets.Dataset`` by slices) only where they differ in size, so a set of fixed-size images costs
those few reads. Where samples cannot be compared (an object with no size), the first batch is probed, as before.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from ..planning.samples import spread_indices
from .transformers_samples import scan_samples

__all__ = ["PEEK", "longest_batch"]

log = logging.getLogger("autobatch")

#: samples, spread over the train set, read to tell whether their sizes vary before the whole set is read
PEEK = 64


def longest_batch(loader: Any, first: Any) -> Any:
    """The batch the probe repeats: ``loader``'s ``collate_fn`` of its dataset's longest and shortest
    samples where the samples' padded sizes vary (module docstring), else ``first`` (the loader's first batch)."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
        return first
    dataset = loader.dataset
    try:
        length = len(dataset)
    except TypeError:
        return first
    if length < 2:
        return first
    spread = spread_indices(length, PEEK)
    if scan_samples([dataset[index] for index in spread], warn=False)[1] is None:
        return first  # one size (or sizes not comparable) over the samples looked at: the first batch is as long
    longest, short, compared = scan_samples(dataset, warn=False)
    if not compared or short is None:
        return first
    log.info("AutoBatchSize: the train set's samples vary in size; probing batches of its longest sample beside its "
             "shortest, collated by the train dataloader's collate_fn (padded as its longest batch)")
    try:
        return loader.collate_fn([longest, short])
    except Exception:  # noqa: BLE001 - a collate_fn that cannot pad two lengths (torch's default_collate, under a
        # sampler that orders by length): the longest twice is as long, and an error there is the loader's own
        return loader.collate_fn([longest, longest])
