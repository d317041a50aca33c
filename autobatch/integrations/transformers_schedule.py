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
scheduler passed in was sized for another number of steps, naming what to change; one where a
``save_steps`` or ``eval_steps`` count no longer comes before the end of the run (:func:`_warn_periods`). Counted as
``Trainer.set_initial_training_values`` counts them, from ``len(train_dataset)`` (each process's
share, ``dataloader_drop_last`` honoured); a dataset without a length is not counted.
"""

from __future__ import annotations

import logging
import math
from typing import Any

__all__ = ["optimizer_steps", "tell_size", "warn_short_last_step"]

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


def tell_size(trainer: Any, before: tuple[Any, int | None], size: int, accumulation: int, world: int, probed: int,
              share: int | None, padded: str | None = None) -> None:
    """The INFO line naming the size set, the samples per optimizer step and the steps ``train()``
    runs; one warning where the schedule was sized for the steps at ``before`` (the user's
    ``(per_device_train_batch_size, gradient_accumulation_steps)``; a size of None: not compared, as on a
    resume, whose schedule was sized when the run began) and the count changed; and
    :func:`warn_short_last_step`'s warning (on a resume ``before`` is ``(None, the checkpoint's
    per-device batch)``). ``padded``: what the probed batches held of the main input
    (:func:`~.transformers_padding.padding_note`), said beside the probe's size."""
    warn_short_last_step(trainer, size, accumulation, world, share, before[1] if before[0] is None else None)
    args = trainer.args
    samples = _length(trainer.train_dataset)
    now = optimizer_steps(args, samples, size, accumulation, world)
    old = optimizer_steps(args, samples, before[0], before[1], world) if isinstance(before[0], int) else None
    steps = "" if now is None else f"; train() runs {now[0]} optimizer step(s) ({now[1]:.3g} epoch(s))"
    if now is not None and old is not None and old[0] != now[0]:
        steps += f" where per_device_train_batch_size={before[0]} ran {old[0]}"
    elif now is not None and old is not None and args.max_steps > 0 and size * accumulation != before[0] * before[1]:
        # max_steps: the samples change (by epochs, both sizes train the set num_train_epochs times)
        steps += (f", {now[0] * size * accumulation * world} samples where per_device_train_batch_size={before[0]} "
                  f"trained {old[0] * before[0] * before[1] * world}")
    log.info("fit_batch_size: per_device_train_batch_size=%d, gradient_accumulation_steps=%d: %d samples per "
             "optimizer step over %d process(es) (probe %d%s)%s%s", size, accumulation, size * accumulation * world,
             world, probed, f", on batches of {padded}" if padded else "", steps,
             "" if share is not None else "; pass global_batch= to keep a global batch")
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
    _warn_periods(args, before[0], old[0], size, now[0])
    # one train() built itself (a trainer trained before) is dropped and rebuilt by the next train()
    if getattr(trainer, "lr_scheduler", None) is not None and not getattr(trainer, "_created_lr_scheduler", False):
        log.warning(
            "fit_batch_size: the learning-rate scheduler passed to the Trainer (%s) was built before the size was "
            "set, for the steps at per_device_train_batch_size=%s (%d); train() now runs %d optimizer steps, so the "
            "schedule will not end where training ends; build it after fit_batch_size, for %d steps (or pass "
            "lr_scheduler_type= and let train() build it)", type(trainer.lr_scheduler).__name__, before[0],
            old[0], now[0], now[0])


def _warn_periods(args: Any, before: int, old: int, size: int, now: int) -> None:
    """One warning where a checkpoint or evaluation period given as a count of steps (``save_steps``,
    ``eval_steps`` under a ``"steps"`` strategy) fired during the ``old`` steps the user's size ran and
    never fires before the end of the ``now`` steps at ``size``. Measured: 64 samples, one epoch,
    ``save_steps=10`` at 2 (32 steps: checkpoints at 10, 20 and 30) set to 26 ran 3 steps and saved
    only at the end, so an interrupted run lost everything it trained, silently."""
    lost, shares = [], []
    for name, strategy in (("save_steps", "save_strategy"), ("eval_steps", "eval_strategy")):
        period, kind = getattr(args, name, None), getattr(args, strategy, None)
        if str(getattr(kind, "value", kind)) == "steps" and isinstance(period, (int, float)) and period >= 1 \
                and now <= period < old:
            lost.append(f"{name}={int(period)}")
            shares.append(f"{name}={period / old:.2g}")
    if lost:
        log.warning("fit_batch_size: %s counted the %d optimizer steps train() ran at per_device_train_batch_size=%s; "
                    "at %d it runs %d, so none comes before the end (no checkpoint or evaluation mid-run); give it as "
                    "a share of the run (%s keeps the cadence) or a count for %d steps", " and ".join(lost), old,
                    before, size, now, ", ".join(shares), now)


def warn_short_last_step(trainer: Any, size: int, accumulation: int, world: int, share: int | None,
                         resumed: int | None) -> None:
    """One warning where ``dataloader_drop_last=True`` and the split set for a process's ``share``
    of a global batch (``size`` x ``accumulation``; None: no global batch, nothing said) ends each
    epoch with a shorter optimizer step, or, resuming, trains other samples an epoch than the
    checkpoint's run did at its per-device batch ``resumed``.

    Why: ``drop_last`` drops only the epoch's last short *micro*-batch, and ``train()`` steps a
    last, shorter window of the batches left (``ceil(batches / accumulation)`` steps an epoch).
    Measured: 40 samples, ``dataloader_drop_last=True``, a run at 16 x 1 (2 steps an epoch, 8
    samples dropped) resumed at the probe's 8 x 2 for the same 16 a step ran 3 steps an epoch: its
    step 3 trained the 8 samples the first run dropped, every later step took other samples than
    the uninterrupted run's, and 2 epochs ran 6 steps, not 4, silently."""
    args = trainer.args
    samples = _length(trainer.train_dataset)
    if share is None or not getattr(args, "dataloader_drop_last", False) or samples is None:
        return
    shard, step = math.ceil(samples / world), size * accumulation
    left = (shard // size) % accumulation  # batches of the epoch's last, short window
    trained, whole = shard // size * size, shard - shard % step
    if resumed is not None and trained == shard // resumed * resumed:
        return  # the resumed epochs are the checkpoint's run's, a short last step included
    if resumed is not None:
        then = optimizer_steps(args, samples, resumed, max(1, step // resumed), world)
        now = optimizer_steps(args, samples, size, accumulation, world)
        said = (f"resuming, per_device_train_batch_size={size} with gradient_accumulation_steps={accumulation} "
                f"trains {trained} samples an epoch{' per process' if world > 1 else ''} under dataloader_drop_last="
                f"True, where the checkpoint's run at {resumed} a batch trained {shard // resumed * resumed}: the "
                f"resumed epochs do not line up with its epochs (samples it dropped are trained, later steps take "
                f"other samples; {now[0] if now else '?'} steps where it ran {then[0] if then else '?'}); where the "
                f"sample order matters, resume where per_device_train_batch_size={resumed} fits")
    elif accumulation > 1 and left:
        said = (f"dataloader_drop_last=True drops only an epoch's last short batch of per_device_train_batch_size="
                f"{size}, so with gradient_accumulation_steps={accumulation} each epoch of {shard} samples"
                f"{' per process' if world > 1 else ''} ends with an optimizer step of {left * size} samples where "
                f"the others train {step}; to keep every step whole, train on {whole} samples"
                f"{' per process' if world > 1 else ''} (a multiple of {step}: train_dataset.select(range("
                f"{whole * world})) for a datasets.Dataset), or pass a global_batch= whose share divides {shard}")
    else:
        return
    log.warning("fit_batch_size: %s", said)


def _length(dataset: Any) -> int | None:
    """``len(dataset)``, or None where it has none (a stream)."""
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None
