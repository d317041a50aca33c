"""Set a ``transformers.Trainer``'s batch size from autobatch's probe, before ``train()``.

:func:`fit_batch_size` probes the trainer's own training step (its model, the optimizer it
creates, its ``compute_loss`` under its accelerator's autocast) on batches its data collator
builds from the *longest* sample of the training set, so the answer holds for every batch the
run will see. It sets ``per_device_train_batch_size`` and, given a ``global_batch``,
``gradient_accumulation_steps`` so each optimizer step keeps exactly that many samples.

Why a function and not a ``TrainerCallback``: by the first callback of ``train()``
(``on_train_begin``) the train dataloader is already built at the old size. Compared with
``TrainingArguments(auto_find_batch_size=True)``: that wraps the training loop in Accelerate's
decorator, so an OOM at any step restarts training from step 0 at ×0.9, and the accumulation
is not adjusted, so the global batch silently changes (transformers#33281); here the probe
runs first, the model and optimizer are restored bit-exactly, and the global batch is kept.

Requires ``transformers`` (``pip install autobatch[transformers]``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from .global_batch import accumulation_for
from .transformers_step import TrainerStep, checkpointing_as_train, trainer_key

__all__ = ["fit_batch_size", "longest_sample"]

log = logging.getLogger("autobatch")


def fit_batch_size(
    trainer: Any,
    *,
    global_batch: int | None = None,
    memory_limit: int | str | None = None,
    margin: float = 0.0,
    multiple_of: int = 1,
    max_batch: int | None = None,
    strategy: str = "auto",
    steps_per_trial: int = 3,
    sample: Mapping[str, Any] | None = None,
    **probe_options: Any,
) -> ProbeResult:
    """Probe ``trainer``'s training step and set its batch size (call before ``trainer.train()``).

    Args:
        trainer: a ``transformers.Trainer`` with a ``train_dataset``.
        global_batch: samples per optimizer step over all processes; sets
            ``gradient_accumulation_steps`` (None: leave it alone).
        memory_limit, margin, multiple_of, max_batch, strategy, steps_per_trial,
            probe_options: for :func:`~autobatch.find_max_batch`.
        sample: the sample batches are built from (default: :func:`longest_sample` of the
            training set, which reads every sample once; a stream's first 1,000).

    Returns the :class:`~autobatch.ProbeResult`; ``trainer.args`` holds the new settings.
    """
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1)))
    if global_batch is not None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer or None, got {global_batch!r}")
        if global_batch % world:
            raise ValueError(f"global_batch={global_batch} does not split over {world} processes; use a multiple")
        max_batch = min(max_batch or global_batch // world, global_batch // world)
    shard = _shard_length(trainer.train_dataset, world)
    if shard is not None and global_batch is not None and global_batch // world > shard:
        raise ValueError(  # an epoch would end first: every optimizer step would train fewer samples
            f"global_batch={global_batch} is larger than the training set ({shard * world} samples"
            f"{f', {shard} per process' if world > 1 else ''}): each epoch would end before one global batch; "
            "lower global_batch"
        )
    if shard is not None:  # no batch larger than a process's share of the training set
        max_batch = min(max_batch or shard, shard)
    if sample is None:
        if trainer.train_dataset is None:
            raise ValueError("fit_batch_size needs trainer.train_dataset (or pass sample=)")
        sample = longest_sample(trainer.train_dataset)
    share = None if global_batch is None else global_batch // world
    # without a global batch, the trainer's own accumulation stays: its window is probed
    accumulation = 1 if share is not None else max(1, int(args.gradient_accumulation_steps))
    step, created = _train_step(trainer, sample, share, accumulation)
    # the Trainer's loop trains the answer, and it cannot replay a step that runs out of memory
    options = {"hand_loop": True, **probe_options}
    # what the step holds beside the model (the window's inputs, a subclass's own step) moves the answer
    options["cache_key"] = {"trainer": trainer_key(trainer), "share": share, "accumulation": accumulation,
                            "user": options.get("cache_key")}
    try:
        result = find_max_batch(step, max_batch=max_batch, memory_limit=memory_limit, margin=margin,
                                multiple_of=multiple_of, strategy=strategy, steps_per_trial=steps_per_trial,
                                device=args.device, **options)
    finally:
        if created:
            trainer.optimizer = None  # train() creates it afresh, as it would have
    size = result.batch_size
    if share is not None:
        accumulation, size = accumulation_for(share, size, multiple_of=multiple_of)
        args.gradient_accumulation_steps = accumulation
    args.per_device_train_batch_size = size
    trainer._train_batch_size = args.train_batch_size  # Trainer copies it at construction
    log.info("fit_batch_size: per_device_train_batch_size=%d, gradient_accumulation_steps=%d: %d samples per "
             "optimizer step over %d process(es) (probe %d)%s", size, accumulation, size * accumulation * world,
             world, result.batch_size, "" if share is not None else "; pass global_batch= to keep a global batch")
    return result


#: samples read from a training set without a length (a stream) in search of the longest
STREAM_SAMPLES = 1000


def longest_sample(dataset: Any) -> Mapping[str, Any]:
    """The worst-case sample: each field at its longest over the training set, as a padded
    batch can meet them. A collator pads every field to its own longest in the batch, so a
    batch may pair one sample's long source with another's long target (seq2seq): the probe's
    sample takes each field from wherever it is longest, measured by its padded size (a
    multiple-choice sample's choices count as choices x their longest). Fields of the same
    length in every sample (token ids and their attention mask) stay the same length.

    A dataset without a length (an ``IterableDataset``, maybe endless) is read for its first
    :data:`STREAM_SAMPLES` samples only, with a warning: pass ``sample=`` to probe at the
    longest one yourself, and always for a stream that cannot be read twice (the samples read
    here would be gone when ``train()`` reads it)."""
    best: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    first = None
    try:
        len(dataset)
    except TypeError:
        dataset = itertools.islice(iter(dataset), STREAM_SAMPLES)
        log.warning("fit_batch_size: the training set has no length (a stream); probing at the longest of its first "
                    "%d samples, which this reads; pass sample= (your longest sample) if a later one is longer, and "
                    "always for a stream that cannot be read twice", STREAM_SAMPLES)
    for item in dataset:
        if not isinstance(item, Mapping):
            return item  # not a record of fields: the first sample stands for all
        first = item if first is None else first
        for key, value in item.items():
            size = _padded_size(value)
            if size > sizes.get(key, -1):
                best[key], sizes[key] = value, size
    if first is None:
        raise ValueError("fit_batch_size: the training set is empty")
    return type(first)(best) if type(first) is not dict and _rebuildable(first) else dict(best)


def _padded_size(value: Any) -> int:
    """The elements ``value`` takes once padded: a sequence's length, a nested sequence's
    outer length times its longest inner one, a tensor's element count; 0 for a scalar."""
    if isinstance(value, torch.Tensor):
        return int(value.numel()) if value.dim() else 0
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        inner = [_padded_size(v) for v in value if isinstance(v, (Sequence, torch.Tensor)) and not isinstance(v, (str, bytes))]
        return len(value) * max(inner) if inner else len(value)
    return 0


def _rebuildable(record: Mapping[str, Any]) -> bool:
    try:
        type(record)({})
        return True
    except TypeError:
        return False


def _shard_length(dataset: Any, world: int) -> int | None:
    """Samples of ``dataset`` each of ``world`` processes trains per epoch (None: no length)."""
    try:
        return max(1, len(dataset) // world) if dataset is not None else None
    except TypeError:
        return None


def _train_step(trainer: Any, sample: Mapping[str, Any], share: int | None,
                accumulation: int) -> tuple["TrainerStep", bool]:
    """The trainer's step as a :class:`TrainerStep`; whether its optimizer was created here.
    Gradient checkpointing is switched on first where ``train()`` would switch it on."""
    checkpointing_as_train(trainer)
    created = trainer.optimizer is None
    if created:
        trainer.create_optimizer()
    trainer.model.train()
    return TrainerStep(trainer, sample, share, accumulation), created
