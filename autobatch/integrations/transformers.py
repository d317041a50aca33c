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

Requires ``transformers`` (``pip install -e ".[transformers]"`` from the checkout).
"""

from __future__ import annotations

import logging
from typing import Any

from .. import checks
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from .global_batch import cap_at_samples, changed_samples, check_share, small_split, split_keeping
from .transformers_loss import warn_unscaled_accumulation
from .transformers_resume import (accumulation_setter, accumulation_where, record_split, restore_accumulation, resumed_batch,
                                  resumed_checkpoint, resumed_global_batch, warn_unseen_resume)
from .transformers_padding import note_padding
from .transformers_samples import SLICE_ROWS, STREAM_SAMPLES, longest_sample, refuse_batched_sample, scan_samples
from .transformers_schedule import tell_size
from .transformers_step import TrainerStep, checkpointing_as_train, trainer_key

__all__ = ["SLICE_ROWS", "STREAM_SAMPLES", "fit_batch_size", "longest_sample"]

log = logging.getLogger("autobatch")


def fit_batch_size(
    trainer: Any,
    *,
    global_batch: int | None = None,
    resume_from_checkpoint: str | bool | None = None,
    memory_limit: int | str | None = None,
    margin: float = 0.0,
    multiple_of: int = 1,
    max_batch: int | None = None,
    strategy: str = "auto",
    steps_per_trial: int = 3,
    sample: Any = None,
    **probe_options: Any,
) -> ProbeResult:
    """Probe ``trainer``'s training step and set its batch size (call before ``trainer.train()``).

    Args:
        trainer: a ``transformers.Trainer`` with a ``train_dataset``.
        global_batch: samples per optimizer step over all processes; sets
            ``gradient_accumulation_steps`` (None: leave it alone, unless the run resumes); one set
            in ``args`` is kept where its per-device batches fit, else replaced with a warning.
        resume_from_checkpoint: what you pass to ``train()`` (a checkpoint's path, ``True``: the
            last in ``args.output_dir``, ``False``: no resume; None: ``args.resume_from_checkpoint``).
            Resuming without ``global_batch`` keeps the checkpoint's samples per optimizer step, so
            the batches ``train()`` skips are the samples already trained (see
            :mod:`~autobatch.integrations.transformers_resume`).
        memory_limit: for :func:`~autobatch.find_max_batch`, as are the five below.
        margin: as ``find_max_batch``'s.
        multiple_of: as ``find_max_batch``'s.
        max_batch: as ``find_max_batch``'s.
        strategy: as ``find_max_batch``'s.
        steps_per_trial: as ``find_max_batch``'s.
        **probe_options: any further option of :func:`~autobatch.find_max_batch`, passed as a
            keyword (``cache=False``), not as a ``probe_options=`` dict as ``AutoBatchSize`` takes them.
        sample: the sample batches are built from, as the training set yields it (default:
            :func:`longest_sample` of the set, read once, a ``datasets.Dataset`` by slices; a stream's
            first 1,000; beside the set's shortest where lengths vary: padded as the run's batches).

    Returns the :class:`~autobatch.ProbeResult`; ``trainer.args`` holds the new settings, which its
    checkpoints record (a callback). Each module's train/eval mode is as it was before the call.
    """
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1)))
    _refuse_data_parallel(args)
    _refuse_options_dict(probe_options)
    global_batch, multiple_of, max_batch = _check_sizes(global_batch, multiple_of, max_batch, world)
    saved = resumed_checkpoint(trainer, resume_from_checkpoint)  # its trainer_state.json, read once a resume
    global_batch, asked = resumed_global_batch(trainer, saved, global_batch, world, multiple_of), global_batch
    _refuse_auto_find(args, global_batch)
    restored = restore_accumulation(trainer, saved, global_batch)  # auto_find: train() takes the checkpoint's batch back
    share = None if global_batch is None else global_batch // world
    start = probe_options.pop("start", None)
    max_batch, start = cap_at_samples(share, max_batch, start, multiple_of, where=f"global_batch={global_batch}")
    shard = _shard_fitting(trainer, global_batch, share, world)
    accumulation = 1 if share is not None else max(1, int(args.gradient_accumulation_steps))  # else its window is probed
    _refuse_rebalance(trainer, world, accumulation)  # with global_batch on one process, once its split is known
    set_for = accumulation_setter(trainer)  # an earlier call's global_batch where that call set the accumulation
    shard = _window_share(shard, accumulation, multiple_of, world, accumulation_where(set_for))  # over a step's batches
    max_batch, start = cap_at_samples(shard, max_batch, start, multiple_of,
                                      where=f"the training set{f' (a process of {world})' if world > 1 else ''}")
    if sample is None and trainer.train_dataset is None:  # an eval-only Trainer: sample= would size training
        raise ValueError("fit_batch_size sizes training and trainer.train_dataset is None: give the Trainer its train_dataset, or pass "
                         "sample=. It does not size evaluation: for trainer.evaluate() alone, set per_device_eval_batch_size yourself")
    refuse_batched_sample(sample, trainer.train_dataset)  # tokenizer(text, return_tensors='pt'): a batch of one
    sample, short, compared = scan_samples(trainer.train_dataset) if sample is None else (sample, None, None)
    # the Trainer's loop trains the answer, and it cannot replay a step that runs out of memory
    options = {"hand_loop": True, **probe_options, "start": start}
    modes = [(module, module.training) for module in trainer.model.modules()]
    created = trainer.optimizer is None
    try:
        step = _train_step(trainer, sample, share, accumulation, short)
        # what the step holds beside the model (the window's inputs, the stand-in for DDP's buckets,
        # a subclass's own step) moves the answer
        options["cache_key"] = {"trainer": trainer_key(trainer), "share": share, "accumulation": accumulation,
                                "ddp_buckets": step.bucket_bytes, "padded": short is not None, "user": options.get("cache_key")}
        result = find_max_batch(step, max_batch=max_batch, memory_limit=memory_limit, margin=margin,
                                multiple_of=multiple_of, strategy=strategy, steps_per_trial=steps_per_trial,
                                device=args.device, **options)
    finally:
        if created:
            trainer.optimizer = None  # train() creates it afresh, as it would have
        for module, training in modes:  # a model in eval() stays in eval(): train() switches it itself
            module.training = training
    # resumed (global_batch from the checkpoint): the schedule was sized when the run began; its batch instead
    size, before = result.batch_size, ((args.per_device_train_batch_size, int(args.gradient_accumulation_steps))
                                       if global_batch == asked and not restored else (None, resumed_batch(trainer, saved)))
    if share is not None:
        accumulation, size, set_for = _set_split(trainer, global_batch, world, size, multiple_of, asked, set_for)
    if not restored:  # train() runs the checkpoint's batch, not the size set
        _warn_changed(trainer, size, accumulation, world, share, multiple_of, accumulation_where(set_for))
    args.per_device_train_batch_size = size  # after _warn_changed, which names the user's size it replaces
    record_split(trainer, set_for)  # train()'s loader size, and its checkpoints record the accumulation
    if asked is None and resume_from_checkpoint is None and getattr(args, "resume_from_checkpoint", None) is None:
        warn_unseen_resume(trainer, size)
    tell_size(trainer, before, size, accumulation, world, result.batch_size, share, note_padding(result, step, sample, short, compared))
    _warn_unprobed(trainer, size, sample)
    return result


def _shard_fitting(trainer: Any, global_batch: int | None, share: int | None, world: int) -> int | None:
    """Each process's share of the training set (None: no length), where it holds ``share`` samples
    (``global_batch`` over ``world``); else a ``ValueError``: an epoch would end before one global
    batch, and every optimizer step would train fewer samples."""
    shard = _shard_length(trainer.train_dataset, world)
    if shard is not None and share is not None and share > shard:
        raise ValueError(
            f"global_batch={global_batch} is larger than the training set ({shard * world} samples"
            f"{f', {shard} per process' if world > 1 else ''}): each epoch would end before one global batch; "
            "lower global_batch"
        )
    return shard


def _warn_unprobed(trainer: Any, size: int, sample: Any) -> None:
    """The warnings on what the probe does not size and ``train()`` will run: evaluations above the
    answer (:func:`_warn_unsized_evaluation`), and accumulated steps whose loss the ``Trainer`` would
    not average (:func:`~autobatch.integrations.transformers_loss.warn_unscaled_accumulation`)."""
    _warn_unsized_evaluation(trainer, size)
    warn_unscaled_accumulation(trainer, sample)


def _warn_unsized_evaluation(trainer: Any, size: int) -> None:
    """One warning where the trainer has an ``eval_dataset`` and a ``per_device_eval_batch_size``
    above the training batch the probe found: evaluation is not probed. The evaluations ``train()``
    runs (``eval_strategy`` other than ``"no"``) run beside the optimizer state; measured (a tiny
    GPT-2, simulated 6 MiB), the probe's 15 trained and the first evaluation at 32 ran out of memory
    mid-run. Under ``eval_strategy="no"`` an ``eval_dataset`` is there for ``trainer.evaluate()``
    (Transformers' example scripts' ``--do_eval``): it was not warned about, and ``evaluate()`` after
    ``train()`` at 64 ran out of memory where the probe answered 5 (simulated 24 MiB)."""
    args = trainer.args
    strategy = getattr(args, "eval_strategy", None) or getattr(args, "evaluation_strategy", None)
    strategy = str(getattr(strategy, "value", strategy) or "no")
    eval_size = getattr(args, "per_device_eval_batch_size", None)
    if getattr(trainer, "eval_dataset", None) is not None and isinstance(eval_size, int) and eval_size > size:
        runs = (f"the evaluations train() runs (eval_strategy={strategy!r})" if strategy != "no"
                else "trainer.evaluate() (given the Trainer's eval_dataset)")
        log.warning(
            "fit_batch_size: evaluation is not probed, and %s use per_device_eval_batch_size=%d, above the %d the "
            "training step fits; they run beside the optimizer state and may run out of memory: set "
            "per_device_eval_batch_size=%d or less (with compute_metrics, eval_accumulation_steps= too, or every "
            "batch's logits stay on the device)", runs, eval_size, size, size)


def _warn_changed(trainer: Any, size: int, accumulation: int, world: int, share: int | None, multiple_of: int,
                  where: str = "TrainingArguments") -> None:
    """One warning where no global batch was asked for and ``size`` changes the samples per
    optimizer step the user's own ``gradient_accumulation_steps`` (above 1) made with their
    ``per_device_train_batch_size`` (:func:`.global_batch.changed_samples`, given a process's samples
    of the training set, so that the ``global_batch`` it names is one that is taken): it was an INFO line
    only, and 16 x 4 became 3 x 4 unseen, as under Transformers' ``auto_find_batch_size``. Under
    ``auto_find_batch_size`` it says to switch that off too: ``global_batch=`` beside it is refused
    (:func:`_refuse_auto_find`), so the advice alone led to that error. ``where`` says who set the
    accumulation (:func:`~.transformers_resume.accumulation_where`: the user, or an earlier call)."""
    args = trainer.args
    changed = share is None and changed_samples(
        args.per_device_train_batch_size, size, accumulation, world, size_setting="per_device_train_batch_size",
        setting="gradient_accumulation_steps", where=where,
        samples=_shard_length(trainer.train_dataset, world), multiple_of=multiple_of)
    if changed:
        auto = ("; with global_batch= set auto_find_batch_size=False too (beside it, it is refused: on an "
                "out-of-memory error train() would lower the batch without raising the accumulation)"
                if getattr(args, "auto_find_batch_size", False) else "")
        log.warning("fit_batch_size: %s%s", changed, auto)


def _set_split(trainer: Any, global_batch: int, world: int, largest: int, multiple_of: int, asked: int | None,
               set_for: int | None) -> tuple[int, int, int | None]:
    """:func:`_split` set on ``trainer.args``: ``(accumulation, per-device batch, set_for)``, ``set_for``
    the ``global_batch`` that chose the accumulation, or None where it is the user's, kept
    (:func:`~.transformers_resume.record_split`). An accumulation an earlier call set (``set_for``
    given) is not the user's to keep: a second call held it as theirs, told them to remove it. A
    split that accumulates under ``batch_rebalance`` is refused before anything is set (:func:`_refuse_rebalance`)."""
    args = trainer.args
    given = None if set_for is not None else int(args.gradient_accumulation_steps)
    accumulation, size = _split(global_batch, world, largest, multiple_of, asked is not None, given)
    _refuse_rebalance(trainer, world, accumulation, asked)
    args.gradient_accumulation_steps = accumulation
    kept = asked is not None and given is not None and 1 < given == accumulation  # the user's own, kept
    return accumulation, size, None if kept else global_batch


def _split(global_batch: int, world: int, largest: int, multiple_of: int, asked: bool,
           given: int | None) -> tuple[int, int]:
    """``(accumulation, per-device batch)`` for a process's share of ``global_batch``. Where
    ``asked`` (the global batch is the caller's, not one a resumed checkpoint's samples per step
    gave, which this run's accumulation already makes up): the user's ``gradient_accumulation_steps``
    (``given``) is kept where it splits the share into batches that fit, else replaced with one
    warning naming both (:func:`.global_batch.split_keeping`), and a share with no divisor near
    ``largest`` is one warning (many small micro-batches a step; :func:`.global_batch.small_split`).
    ``given`` is None where an earlier ``fit_batch_size`` call set it (not the user's to keep)."""
    given = int(given) if asked and given is not None else None
    warn = asked
    accumulation, size, replaced, fewer = split_keeping(
        global_batch, world, largest, given, multiple_of=multiple_of, setting="gradient_accumulation_steps",
        where="TrainingArguments", unit="process")
    if replaced:
        log.warning("fit_batch_size: %s", replaced)
    elif fewer:
        log.info("fit_batch_size: kept TrainingArguments(gradient_accumulation_steps=%d) for global_batch=%d; %d "
                 "would fit (drop gradient_accumulation_steps to let global_batch set it)", accumulation,
                 global_batch, fewer)
    kept = given is not None and given > 1 and accumulation == given  # the user's own split: no advice on it
    split = warn and not kept and small_split(global_batch, world, largest, size, multiple_of=multiple_of,
                                              unit="process")
    if split:
        log.warning("fit_batch_size: %s", split)
    return accumulation, size


def _refuse_options_dict(probe_options: dict[str, Any]) -> None:
    """One ``TypeError`` for ``probe_options=`` (``AutoBatchSize``'s spelling): here
    ``find_max_batch``'s options are keywords, and the dict would reach it as one unknown option."""
    if "probe_options" in probe_options:
        raise TypeError(f"fit_batch_size takes find_max_batch's options as keywords (fit_batch_size(trainer, "
                        f"cache=False)), not as probe_options=...; pass **{probe_options['probe_options']!r:.60}")


def _refuse_data_parallel(args: Any) -> None:
    """One ``ValueError`` where ``train()`` would wrap the model in ``torch.nn.DataParallel``:
    several GPUs visible to one process that no launcher started (``args.n_gpu`` > 1). Each
    step then trains ``per_device_train_batch_size`` times the GPUs, and the first GPU also
    holds the gathered outputs and the loss of the whole batch, so neither the answer nor the
    global batch's arithmetic (one process, ``world_size`` 1) would be that of the run."""
    gpus = int(getattr(args, "n_gpu", 1) or 1)
    if gpus > 1 and int(getattr(args, "world_size", 1) or 1) == 1:
        raise ValueError(
            f"fit_batch_size: this process sees {gpus} GPUs, so Trainer.train() would run torch.nn.DataParallel "
            "over them (per_device_train_batch_size x GPUs a step, the outputs gathered on the first), which the "
            "probe does not model; launch one process per GPU (torchrun --nproc-per-node "
            f"{gpus} your_script.py, or accelerate launch), or make one GPU visible (CUDA_VISIBLE_DEVICES=0)"
        )


def _refuse_rebalance(trainer: Any, world: int, accumulation: int, global_batch: int | None = None) -> None:
    """One ``ValueError`` for ``train_sampling_strategy="batch_rebalance"`` (transformers 5) where an
    optimizer step has several micro-batches (``world`` x ``accumulation``): its ``BatchRebalanceSampler``
    balances their padded-token cost by moving samples between them, so one may hold more samples than
    ``per_device_train_batch_size``, each padded to its longest, which the probe's batches (that many
    samples, the longest among them) do not bound. Measured (CPU, a tiny GPT-2, samples of 40 and 1
    token, simulated 12 MiB): the probe answered 28 with 4 accumulation steps, the sampler formed
    micro-batches of 38, and ``train()`` ran out of memory; simulated windows held up to 1.75 x the
    batch of longest-length samples. One micro-batch a step is the whole window, as probed. The
    ``Trainer`` ignores the strategy for a training set without a length, as this does."""
    args = trainer.args
    if (str(getattr(args, "train_sampling_strategy", "random")) != "batch_rebalance" or world * accumulation <= 1
            or _shard_length(trainer.train_dataset, world) is None):
        return
    steps = (f"{world} processes x {accumulation} accumulation step(s)" if world > 1 else
             f"gradient_accumulation_steps={accumulation}" + (f" for global_batch={global_batch}" if global_batch else ""))
    raise ValueError(
        f"fit_batch_size: TrainingArguments(train_sampling_strategy='batch_rebalance') splits each optimizer step into "
        f"{world * accumulation} micro-batches ({steps}) of varying sample counts, more samples than "
        "per_device_train_batch_size in some, padded to their longest, which the probe's batches do not bound (train() "
        "ran out of memory at the probe's answer); set train_sampling_strategy='group_by_length' (batches of "
        "per_device_train_batch_size, the longest first), or set the batch size yourself")


def _refuse_auto_find(args: Any, global_batch: int | None) -> None:
    """One ``ValueError`` for ``global_batch`` beside ``auto_find_batch_size=True``: on an OOM in
    ``train()`` that restarts the loop at x0.9 the per-device batch without raising
    ``gradient_accumulation_steps`` (transformers#33281), and a run resumed from a checkpoint
    takes the checkpoint's per-device batch back, so the global batch asked for would not hold,
    silently. Without ``global_batch`` it may stay on, as a fallback starting at the answer."""
    if global_batch is not None and getattr(args, "auto_find_batch_size", False):
        raise ValueError(
            f"fit_batch_size(global_batch={global_batch}) with TrainingArguments(auto_find_batch_size=True): on an "
            "out-of-memory error train() would lower per_device_train_batch_size without raising "
            "gradient_accumulation_steps, so the global batch would not hold; set auto_find_batch_size=False (the "
            "probe replaces it), or drop global_batch"
        )


def _check_sizes(global_batch: int | None, multiple_of: int, max_batch: int | None,
                 world: int) -> tuple[int | None, int, int | None]:
    """One ``ValueError`` for sizes no probe can serve, before any sample is read or trial run
    (``find_max_batch`` checks the rest; these are used here before it is called); the sizes as
    plain ints (``trainer.args`` is saved as JSON)."""
    max_batch = checks.positive_int("max_batch", max_batch, allow_none=True)  # 0 is refused, not "no cap"
    multiple_of = checks.positive_int("multiple_of", multiple_of)
    global_batch = checks.positive_int("global_batch", global_batch, allow_none=True)
    if global_batch is not None:
        check_share(global_batch, world, multiple_of, unit="process")
    return global_batch, multiple_of, max_batch


def _shard_length(dataset: Any, world: int) -> int | None:
    """Samples of ``dataset`` each of ``world`` processes trains per epoch (None: no length)."""
    try:
        return max(1, len(dataset) // world) if dataset is not None else None
    except TypeError:
        return None


def _window_share(shard: int | None, accumulation: int, multiple_of: int, world: int,
                  where: str = "TrainingArguments") -> int | None:
    """The largest batch a process's ``shard`` of the training set gives ``accumulation`` of (the
    user's ``gradient_accumulation_steps``, kept without ``global_batch``), so that every optimizer
    step takes the batches the probe sized and the samples the warning names. Capped at the shard
    alone, a 10-sample set with 4 steps of accumulation was given batches of 10: one batch an epoch,
    each optimizer step one batch (10 samples, not the 40 said), and the probe sized a window of 4
    that never ran. A shard smaller than ``accumulation`` batches of ``multiple_of`` is one
    ``ValueError`` naming what to change, and who set the accumulation (``where``)."""
    if shard is None or accumulation <= 1:
        return shard
    if shard < accumulation * multiple_of:
        raise ValueError(
            f"the training set has {shard} samples{' per process' if world > 1 else ''}, fewer than "
            f"gradient_accumulation_steps={accumulation} batches of {multiple_of} (multiple_of): no optimizer step "
            f"could take its {accumulation} batches; lower gradient_accumulation_steps (set on {where}) "
            "or use more samples")
    return shard // accumulation


def _train_step(trainer: Any, sample: Any, share: int | None, accumulation: int, short: Any = None) -> TrainerStep:
    """The trainer's step as a :class:`TrainerStep`, its optimizer created where it has none yet.
    Gradient checkpointing is switched on first where ``train()`` would switch it on, and the
    model placed on ``args.device`` where ``train()`` places it: under ``bf16_full_eval`` or
    ``fp16_full_eval`` the ``Trainer``'s ``__init__`` leaves it where it was built (on a GPU the
    probe's batches then met a host model: a device-mismatch error, no trial)."""
    args = trainer.args
    if ((getattr(args, "fp16_full_eval", False) or getattr(args, "bf16_full_eval", False))
            and not getattr(trainer, "is_model_parallel", False) and getattr(trainer, "model_init", None) is None):
        trainer._move_model_to_device(trainer.model, args.device)  # as train() does before its first step
    checkpointing_as_train(trainer)
    if trainer.optimizer is None:
        trainer.create_optimizer()
    trainer.model.train()
    return TrainerStep(trainer, sample, share, accumulation, short)
