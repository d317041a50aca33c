"""What the size :func:`~autobatch.integrations.transformers.fit_batch_size` set does to ``train()``'s length and schedule.

Why: ``train()`` counts its optimizer steps from the per-device batch (``num_train_epochs``
times the updates per epoch, unless ``max_steps`` is set), so a new size changes the steps the
learning-rate schedule spans, or, under ``max_steps``, the samples the run trains. Nothing said
so, and a warmup given as a number of steps (``warmup_steps=10``, sized for the steps at the old
batch) silently took another share of the run: with 64 samples, ``num_train_epochs=2`` and
``per_device_train_batch_size=2`` (64 steps) set to 28, ``train()`` ran 4 steps, all of them
warmup, and the learning rate never reached its peak nor decayed. A learning-rate scheduler
passed to the ``Trainer`` (``optimizers=(optimizer, scheduler)``) was built for the old count the
same way (``OneCycleLR`` raises once stepped past its total); one a previous ``train()`` built
itself (``trainer._created_lr_scheduler``) is not: the next ``train()`` rebuilds it for its steps.

What: the INFO line names the optimizer steps and epochs ``train()`` will run at the size set
(and at the old one, where they differ); one warning where an integer ``warmup_steps`` or a
scheduler passed in was sized for another number of steps, naming what to change. Counted as
``Trainer.set_initial_training_values`` counts them, from ``len(train_dataset)`` (each process's
share, ``dataloader_drop_last`` honoured); a dataset without a length is not counted.
"""

from __future__ import annotations

import logging
import math
from typing import Any

__all__ = ["optimizer_steps", "tell_size"]

log = logging.getLogger("autobatch")


def optimizer_steps(args: Any, samples: int | None, size: int, accumulation: int, world: int) -> tuple[int, float] | None:
    """``(optimizer steps, epochs)`` that ``train()`` runs at ``size`` x ``accumulation`` per
    process over ``world`` processes on ``samples`` training samples (None: not countable)."""
    if samples is None or size < 1:
        return None
    share = math.ceil(samples / world)
    batches = share // size if getattr(args, "dataloader_drop_last", False) else math.ceil(share / size)
    if batches < 1:
        return None
    per_epoch = max(math.ceil(batches / accumulation), 1)
    if args.max_steps > 0:
        return args.max_steps, args.max_steps / per_epoch
    return math.ceil(args.num_train_epochs * per_epoch), float(args.num_train_epochs)


def tell_size(trainer: Any, before: tuple[Any, int], size: int, accumulation: int, world: int, probed: int,
              share: int | None) -> None:
    """The INFO line naming the size set, the samples per optimizer step and the steps ``train()``
    runs; one warning where the schedule was sized for the steps at ``before`` (the user's
    ``(per_device_train_batch_size, gradient_accumulation_steps)``; a size of None: not compared, as on a
    resume, whose schedule was sized when the run began) and the count changed."""
    args = trainer.args
    samples = _length(trainer.train_dataset)
    now = optimizer_steps(args, samples, size, accumulation, world)
    old = optimizer_steps(args, samples, before[0], before[1], world) if isinstance(before[0], int) else None
    steps = "" if now is None else f"; train() runs {now[0]} optimizer step(s) ({now[1]:.3g} epoch(s))"
    if now is not None and old is not None and old[0] != now[0]:
        steps += f" where per_device_train_batch_size={before[0]} ran {old[0]}"
    elif now is not None and old is not None and size * accumulation != before[0] * before[1]:  # max_steps: the samples change
        steps += (f", {now[0] * size * accumulation * world} samples where per_device_train_batch_size={before[0]} "
                  f"trained {old[0] * before[0] * before[1] * world}")
    log.info("fit_batch_size: per_device_train_batch_size=%d, gradient_accumulation_steps=%d: %d samples per "
             "optimizer step over %d process(es) (probe %d)%s%s", size, accumulation, size * accumulation * world,
             world, probed, steps, "" if share is not None else "; pass global_batch= to keep a global batch")
    if now is None or old is None or old[0] == now[0]:
        return
    warmup = getattr(args, "warmup_steps", 0) or 0
    if warmup >= 1:  # a count, not a share of the run (a float below 1 is one; so is warmup_ratio before 5)
        log.warning(
            "fit_batch_size: warmup_steps=%d was sized for the %d optimizer steps train() ran at "
            "per_device_train_batch_size=%s (%.0f%% of them); at %d it runs %d, so the warmup is %s; give the "
            "warmup as a share of the run (warmup_steps=%.2g in Transformers 5, warmup_ratio before) or a count "
            "for %d steps", int(warmup), old[0], before[0], 100 * min(1.0, warmup / old[0]), size, now[0],
            "all of them: the learning rate never reaches its peak nor decays" if warmup >= now[0]
            else f"{100 * warmup / now[0]:.0f}% of them", max(min(warmup / old[0], 0.99), 0.01), now[0])
    # one train() built itself (a trainer trained before) is dropped and rebuilt by the next train()
    if getattr(trainer, "lr_scheduler", None) is not None and not getattr(trainer, "_created_lr_scheduler", False):
        log.warning(
            "fit_batch_size: the learning-rate scheduler passed to the Trainer (%s) was built before the size was "
            "set, for the steps at per_device_train_batch_size=%s (%d); train() now runs %d optimizer steps, so the "
            "schedule will not end where training ends; build it after fit_batch_size, for %d steps (or pass "
            "lr_scheduler_type= and let train() build it)", type(trainer.lr_scheduler).__name__, before[0],
            old[0], now[0], now[0])


def _length(dataset: Any) -> int | None:
    """``len(dataset)``, or None where it has none (a stream)."""
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None
