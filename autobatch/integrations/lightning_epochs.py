"""Checks of an epoch's length at the size ``AutoBatchSize`` set, before ``fit`` trains.

A larger batch shortens the epoch: a ``limit_train_batches`` or an integer ``val_check_interval``
that held at the module's own size may no longer (see :func:`check_limit` and
:func:`check_val_interval`), nor a fractional ``limit_val_batches`` for a val dataloader built from
the size (:func:`check_val_limit`). Each is one ``ValueError`` naming what to change. A fractional
``limit_train_batches`` caps the batch instead (:func:`epoch_cap`), as the dataset does. With no
``global_batch``, an accumulation window that no longer divides the epoch's batches is one warning
(:func:`changed_step`). A ``fit`` that trains nothing (:func:`fit_ended`) is not probed.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Trainer

from ..memory.units import counted
from ..training.checkpoints.checkpoint_io import rng_state, set_rng_state
from .global_batch import changed_samples
from .lightning_loop import refuses_interval
from .lightning_schedules import train_loader
from .lightning_tuners import tell

__all__ = ["fit_ended", "check_limit", "check_validation", "check_val_interval", "check_val_limit", "epoch_cap",
           "dropped_note", "changed_step", "scheduled_step", "fewest_batches"]


def fit_ended(trainer: Trainer, name: str, size: Any) -> bool:
    """Whether ``fit`` trains nothing from its start, told in one INFO line: a later ``fit`` on a
    trainer whose ``max_steps`` or ``max_epochs`` an earlier ``fit`` reached (``FitLoop.done``'s
    limits). The callback does not probe there (``name=size`` kept): its confirmation run could take
    no step, so the probe's answer was set unconfirmed, replacing the size the first fit confirmed,
    with a warning to set ``max_batch``. A resumed fit's loops are restored after ``on_fit_start``."""
    loop = trainer.fit_loop
    epochs = loop.epoch_progress.current.processed
    if loop.max_steps not in (None, -1) and trainer.global_step >= loop.max_steps:
        ended = f"max_steps={loop.max_steps} reached already (global_step={trainer.global_step})"
    elif loop.max_epochs not in (None, -1) and epochs >= loop.max_epochs:
        ended = f"max_epochs={loop.max_epochs} reached already ({counted(epochs, 'epoch')} trained)"
    else:
        return False
    tell("AutoBatchSize: %s: fit trains nothing; not probed, %s=%s kept", ended, name, size)
    return True


def epoch_cap(trainer: Trainer, samples: int | None) -> tuple[int | None, str]:
    """The largest batch an epoch can train (None: unknown) and what sets it, for
    :func:`~.global_batch.cap_at_samples`: a rank's ``samples``, or, under a fractional
    ``limit_train_batches`` (0 < f < 1), the samples of the fewest batches ``n`` with
    ``int(n * f) >= 1`` split evenly (every one full, as under ``drop_last``).

    Why: Lightning trains ``int(batches * f)`` batches an epoch and refuses ``fit`` where that is
    0 ("You requested to check 0.5 of the `train_dataloader` but 0.5 * 1 < 1"): with 512 samples
    and ``limit_train_batches=0.5`` the probe's 374 left an epoch one batch, and ``fit`` failed
    after the callback with an error naming neither it nor its size."""
    limit, where = trainer.limit_train_batches, "the train dataset"
    if samples is None or not isinstance(limit, float) or not 0.0 < limit < 1.0:
        return samples, where
    batches = fewest_batches(limit)
    return samples // batches, (f"a batch of the train dataset under limit_train_batches={limit!r} (Lightning trains "
                                f"none of an epoch with fewer than {batches} batches; raise limit_train_batches)")


def fewest_batches(limit: float) -> int:
    """The fewest batches ``n`` of which Lightning runs one or more under a fractional limit: ``int(n * limit) >= 1``."""
    batches = math.ceil(1 / limit)
    while int(batches * limit) < 1:  # float rounding: 1 / 0.1 may round to a count whose product is below 1
        batches += 1
    return batches


def check_limit(trainer: Trainer, global_batch: int | None, accumulation: int | None, size: int | None,
                samples: int | None, fewer: int | None = None) -> None:
    """One error where ``limit_train_batches`` ends each epoch before one global batch.

    Why: Lightning steps the optimizer at an epoch's end with the micro-batches it has, so an
    epoch of fewer batches than the accumulation trains fewer samples per step than
    ``global_batch``, silently (as ``AutoBatchSize``'s dataset check, for the limit).
    ``samples``: a rank's samples per epoch (None: unknown; only an integer limit is checked).
    Batches are counted as a ``DataLoader`` without ``drop_last`` (its default) counts them, a
    last partial batch included; under ``drop_last`` a fraction may leave ``fit`` one batch
    fewer than counted here. ``fewer``: where ``accumulation`` is the Trainer's own
    ``accumulate_grad_batches``, kept though the probe found fewer micro-batches a step fit (the
    split's ``fewer``), that number: where its larger micro-batches fit in the limit, the error
    names removing the Trainer's setting too (``4`` kept as 64 x 4 under 3 batches, where 256 x 1 fits)."""
    limit = trainer.limit_train_batches
    if global_batch is None or not accumulation or accumulation <= 1 or not size or size < 1:
        return
    batches = _limited_batches(limit, samples, size)
    if batches is None or batches >= accumulation:
        return
    whole = None if samples is None else -(-samples // size)
    fraction = "" if isinstance(limit, int) or not whole else f" (a fraction of at least {accumulation}/{whole})"
    larger = -(-size * accumulation // fewer) if fewer else None  # the micro-batch of ``fewer`` a step
    own = (f", remove (or lower) the Trainer's own accumulate_grad_batches={accumulation} (global_batch then sets "
           f"{counted(fewer, 'micro-batch', 'micro-batches')} of {larger} a step, which the probe found fit, within "
           f"the limit)" if larger and (_limited_batches(limit, samples, larger) or 0) >= fewer else "")
    raise ValueError(
        f"limit_train_batches={limit!r} leaves {batches} batch(es) of {size} per epoch, fewer than the "
        f"{accumulation} micro-batches each optimizer step accumulates for global_batch={global_batch}: "
        f"every epoch would end before one global batch; raise limit_train_batches to {accumulation} batches or "
        f"more{fraction}{own}, or lower global_batch"
    )


def _limited_batches(limit: Any, samples: int | None, size: int) -> int | None:
    """The batches of ``size`` an epoch of ``samples`` trains under ``limit_train_batches``
    (:func:`check_limit`); None where unknown (a fraction of an endless loader: Lightning accepts only 1.0)."""
    whole = None if samples is None else -(-samples // size)
    if isinstance(limit, int):
        return limit if whole is None else min(limit, whole)
    if whole is None or limit is None:
        return None
    return int(whole * limit)


def check_validation(trainer: Trainer, size: int | None, multiple_of: int, samples: int | None) -> None:
    """The checks of what ``fit`` validates at the size set: :func:`check_val_interval`, :func:`check_val_limit`."""
    check_val_interval(trainer, size, multiple_of, samples)
    check_val_limit(trainer, size)


def check_val_limit(trainer: Trainer, size: int | None) -> None:
    """One error, before ``fit`` trains, where a fractional ``limit_val_batches`` (0 < f < 1) leaves
    a val dataloader built at the size set no batch to validate.

    Why: Lightning validates ``int(batches * f)`` batches of each val dataloader and refuses ``fit``
    where that is 0 ("You requested to check 0.1 of the `val_dataloader` but 0.1 * 1 < 1"), in its
    sanity check, after the callback's probe and confirmation (which validate one batch). A val
    loader built from the batch attribute (often at twice the size) has few batches at a probed
    size: ``limit_val_batches=0.1`` over 512 samples at batch 2 held, and failed at the probe's 374
    with an error naming neither the callback nor its size. The limit is not changed (it would
    validate other batches than asked). The val dataloaders are built as ``fit`` builds them (the
    val loop's ``setup_data``), counted whole, then dropped; the random states put back."""
    limit = trainer.limit_val_batches
    if not size or size < 1 or not isinstance(limit, float) or not 0.0 < limit < 1.0:
        return
    loop, saved = trainer.fit_loop.epoch_loop.val_loop, rng_state()
    kept = loop._max_batches, getattr(loop, "_last_val_dl_reload_epoch", None)
    trainer.limit_val_batches, loop._combined_loader, loop._max_batches = 1.0, None, []  # counted whole
    try:
        loop.setup_data()
        lengths = list(loop._max_batches)
    finally:
        trainer.limit_val_batches, loop._combined_loader = limit, None  # fit builds its own at the size
        loop._max_batches, loop._last_val_dl_reload_epoch = kept
        set_rng_state(saved)
    short = [batches for batches in lengths if batches != float("inf") and batches > 0 and int(batches * limit) < 1]
    if not short:
        return
    batches = min(short)
    fraction = next(rounded for digits in range(len(str(batches)) + 1, 18)  # 0.17, not 0.16666666666666666
                    if int(batches * (rounded := min(1.0, math.ceil(10 ** digits / batches) / 10 ** digits))) >= 1)
    setting = "overfit_batches" if trainer.overfit_batches > 0 else "limit_val_batches"  # which sets the limit
    raise ValueError(
        f"AutoBatchSize: at batch size {size} {'the' if len(lengths) == 1 else 'a'} val dataloader has {batches} "
        f"batch(es), and Trainer({setting}="
        f"{limit!r}) validates int({batches} x {limit!r}) = 0 of them, which Lightning refuses: fit would fail. Change "
        f"one: {setting} at least {fraction!r}, an integer {setting} (a count of batches: 1 validates one), "
        f"AutoBatchSize(max_batch=N) with N low enough for {fewest_batches(limit)} val batches or more"
        + ("" if setting == "overfit_batches" else ", or limit_val_batches=0 for no validation")
    )


def check_val_interval(trainer: Trainer, size: int | None, multiple_of: int, samples: int | None) -> None:
    """One error, before ``fit`` trains, where an integer ``val_check_interval`` is longer than an
    epoch at the size set.

    Why: Lightning counts such an interval in batches within an epoch and refuses one above the
    epoch's batches (unless ``check_val_every_n_epoch=None``); a larger batch shortens the epoch,
    so an interval that held at the module's own size failed ``fit`` with Lightning's
    ``ValueError``, naming neither the callback nor its size. The interval is not changed (it
    would validate at other points than asked) and the size is not cut silently: the error
    names what to change. The batches are counted as ``fit`` counts them (the loader is built,
    then dropped, the random states put back). ``samples``: a rank's per epoch (None: unknown)."""
    interval = trainer.val_check_interval
    if not size or size < 1 or not trainer.limit_train_batches or not refuses_interval(trainer, 1):
        return  # no epoch is too short for the interval (refused at 1 batch: refused at some length)
    trainer.fit_loop._combined_loader = None  # counted at the size set
    with train_loader(trainer) as batches:
        pass
    if not refuses_interval(trainer, batches):
        return
    limit, multiple = trainer.limit_train_batches, multiple_of
    whole = isinstance(limit, float) and limit == 1.0  # an int limit of 1 is one batch
    cap = samples // interval // multiple * multiple if samples and (whole or isinstance(limit, int) and limit >= interval) else 0
    raise ValueError(
        f"AutoBatchSize: at batch size {size} an epoch has {batches} training batch(es)"
        f"{'' if whole else f' (limit_train_batches={limit!r})'}, fewer than Trainer(val_check_interval="
        f"{interval}), which Lightning counts within an epoch and refuses above the epoch's batches: fit would "
        f"fail. Change one: Trainer(check_val_every_n_epoch=None) to validate every {interval} batches counted "
        f"across epochs, a val_check_interval of at most {batches} (or a float, a fraction of each epoch)"
        + (f", AutoBatchSize(max_batch={cap}) for epochs of at least {interval} batches" if cap else "")
        + ", or limit_val_batches=0 for no validation"
    )


def dropped_note(own: Any, size: int, samples: int | None, drop_last: bool) -> str | None:
    """What to say where the train dataloader drops its last partial batch (``drop_last=True``)
    and the size set drops far more of each epoch than the module's own size did (a tenth of it
    or more), else None. Why: with 512 samples, the probe's 374 left 138 of them (27 %) out of
    every epoch where the module's 2 left none, and nothing said so (Lightning's
    ``BatchSizeFinder`` says nothing either)."""
    if not drop_last or samples is None or not isinstance(own, int) or own < 1 or size < 1:
        return None
    dropped, before = samples % size, samples % own
    if dropped <= before or dropped * 10 < samples:
        return None
    return (f"with drop_last=True, batch size {size} leaves {dropped} of the {samples} samples of a rank's epoch "
            f"({100 * dropped // samples} %) untrained every epoch, where the module's own {own} left {before}: set "
            f"drop_last=False (the last batch is then partial), or a max_batch that divides {samples} better")


def changed_step(trainer: Trainer, own: Any, size: int, world: int, *, name: str, samples: int | None,
                 drop_last: bool, multiple_of: int) -> str | None:
    """The one warning where, with no ``global_batch``, the size set changes what each optimizer
    step of the Trainer's own ``accumulate_grad_batches`` trains (None where it does not): the
    samples per step (:func:`~.global_batch.changed_samples`), and where the window no longer
    divides the epoch's batches (:func:`_window`), what Lightning steps on instead.

    Why: Lightning counts the window within an epoch and steps at the epoch's end on the batches it
    has (``_TrainingEpochLoop._should_accumulate``: ``_accumulated_batches_reached`` or
    ``_num_ready_batches_reached``), each loss still divided by the full window. With 512 samples,
    ``drop_last=True`` and ``accumulate_grad_batches=4``, the size 308 left one batch an epoch:
    the warning said each step trained 4 x 308 = 1232 samples, where each trained 308, at a quarter
    of their mean gradient. The batches are counted as ``fit`` counts them (the loader is built, then
    dropped); only a size that differs from the module's own is checked (the user's own is theirs)."""
    accumulation = trainer.accumulate_grad_batches
    changed = changed_samples(own, size, accumulation, world, size_setting=name, setting="accumulate_grad_batches",
                              where="the Trainer", samples=samples, multiple_of=multiple_of)
    if not changed:
        return None
    with train_loader(trainer) as batches:
        pass
    if not isinstance(batches, int) or batches < 1:
        return changed
    whole = _whole_epoch(trainer, samples)
    epoch = None if whole is None else batches * size if drop_last else min(whole, batches * size)  # a rank's
    short = batches == accumulation and epoch is not None and epoch < batches * size  # one window, a partial batch
    if batches % accumulation == 0 and not short:
        return changed
    full, rest = divmod(batches, accumulation)
    fix = _window_fix(whole, size, accumulation, drop_last, multiple_of) if rest else ""
    ranks = f" over {world} processes" if world > 1 else ""
    scale = (f" at {rest}/{accumulation} of the mean gradient, as Lightning divides each loss by {accumulation}"
             if rest else "")
    if full == 0 or short:  # one window an epoch, not full: the samples-per-step message would be false
        old, trained = own * accumulation * world, (f"{epoch * world}" if epoch is not None
                                                    else f"at most {batches * size * world}")
        return (f"an epoch at {name}={size} has {batches} batch(es) ({trained} samples{ranks}), "
                f"{'fewer than' if rest else 'one window of'} accumulate_grad_batches={accumulation}, and Lightning "
                f"steps at each epoch's end on the batches it has: every optimizer step trains that epoch{scale}, not "
                f"{accumulation} x {size} samples, where {name}={own} trained {old} a step, so the learning rate and "
                f"schedule tuned for {old} no longer match; pass global_batch={old} to keep {old} samples a step{fix}, "
                "or set accumulate_grad_batches=1 to train the probe's batch alone")
    return (f"{changed}. Also, an epoch at {name}={size} has {batches} batches, which accumulate_grad_batches="
            f"{accumulation} does not divide, and Lightning steps at each epoch's end on the batches it has: {full} "
            f"step(s) an epoch train {accumulation} batches and the last trains {rest} batch(es) (at most "
            f"{rest * size * world} samples{ranks}){scale}; pass global_batch, an accumulate_grad_batches that divides "
            f"{batches}{fix}")


def _whole_epoch(trainer: Trainer, samples: int | None) -> int | None:
    """The samples an epoch trains: all of ``samples`` where ``limit_train_batches`` leaves the
    epoch whole (1.0), else None (a share or a count of batches: the epoch is not the data)."""
    limit = trainer.limit_train_batches
    return samples if isinstance(limit, float) and limit == 1.0 else None


def _window_fix(samples: int | None, size: int, accumulation: int, drop_last: bool, multiple: int) -> str:
    """``", max_batch=S (N batches an epoch)"``: the largest size below ``size`` (a multiple of
    ``multiple``) whose epoch of ``samples`` is whole windows of ``accumulation`` full batches (with
    ``drop_last``, a multiple of ``accumulation`` batches; without it, ``samples`` a multiple of
    ``S x accumulation``); empty where ``samples`` is unknown (or limited) or none does. Why full
    batches: without ``drop_last``, 512 samples in windows of 2 were answered ``max_batch=511``, two
    batches of 511 and 1, where Lightning's mean over the window weighs that one sample as the 511."""
    if not samples:
        return ""
    for smaller in range(size // multiple * multiple, 0, -multiple):
        batches = samples // smaller if drop_last else -(-samples // smaller)
        if batches and batches % accumulation == 0 and (drop_last or samples % smaller == 0):
            return f", max_batch={smaller} ({batches} batches an epoch, a multiple of {accumulation})"
    return ""


def scheduled_step(trainer: Trainer, own: Any, size: int, world: int, *, name: str, samples: int | None,
                   drop_last: bool, multiple_of: int) -> str | None:
    """The one warning where, with no ``global_batch``, the size set changes what each optimizer
    step of a ``GradientAccumulationScheduler`` trains (None where there is none, or the size is
    the module's own): :func:`changed_step` for a schedule of windows.

    Why: the scheduler sets ``accumulate_grad_batches`` at each epoch's start, after the callback
    ran, so :func:`changed_step` saw 1 and said nothing. With 512 samples, ``drop_last=True``, a
    module batch of 2 and ``GradientAccumulationScheduler({0: 2, 1: 4})``, the size 374 left one
    batch an epoch: every step trained those 374 samples at half (then a quarter) of their mean
    gradient, where the schedule was tuned for 4 then 8 samples a step, silently (Lightning's
    ``BatchSizeFinder`` too). ``global_batch`` is refused beside the scheduler, so the fixes named
    are a ``max_batch`` whose epoch the windows divide, or a schedule without the change."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    scheduler = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)
    if scheduler is None or size == own or not isinstance(own, int) or isinstance(own, bool) or size < 1:
        return None
    windows = sorted({int(k) for k in scheduler.scheduling.values()})
    if windows == [1]:
        return None
    with train_loader(trainer) as batches:
        pass
    ranks = f" over {world} processes" if world > 1 else ""
    counted = batches if isinstance(batches, int) and batches >= 1 else max(windows)  # an epoch's steps train at most
    schedule = ", ".join(f"{window} from epoch {epoch}" for epoch, window in sorted(scheduler.scheduling.items()))
    said = (f"{name}={size} with the GradientAccumulationScheduler's accumulate_grad_batches ({schedule}) trains "
            f"{' / '.join(str(size * min(w, counted) * world) for w in windows)} samples per optimizer step{ranks} "
            f"where {name}={own} "
            f"trained {' / '.join(str(own * w * world) for w in windows)}, so the learning rate and schedule tuned for "
            "those no longer match")
    short = [w for w in windows if isinstance(batches, int) and batches >= 1 and batches % w]
    if short:
        said += (f"; also, an epoch at {name}={size} has {batches} batch(es), which accumulate_grad_batches="
                 f"{' or '.join(map(str, short))} does not divide, and Lightning steps at each epoch's end on the "
                 "batches it has, each loss still divided by the full window")
    fix = _window_fix(_whole_epoch(trainer, samples), size, math.lcm(*windows), drop_last, multiple_of)
    return (f"{said}. Set a max_batch whose epoch the windows divide{fix}, or change the schedule "
            "(global_batch is refused beside a GradientAccumulationScheduler, which changes the accumulation by epoch)")
