"""What the runner checks of its arguments and its data: one clear error naming what to change.

Kept apart from :mod:`autobatch.training.runner` (the step loop): each check here turns an
input that trained the wrong thing silently, or failed later with an error naming no argument,
into one error at the call that passed it. ``checkpoint_every`` without ``checkpoint_dir`` wrote
nothing; ``device="cuda"`` on a machine without CUDA failed at the first transfer with torch's
bare ``AssertionError``; ``fit((x, y))`` trained ``x`` and ``y`` as two batches; a list of
per-sample items (``collate_fn=list``) was split along the wrong dimension with a warning; a
``min_micro_batch`` the global batch cannot be cut by left a one-sample piece.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from .. import checks
from ..memory.units import counted, parse_bytes
from ..planning.accumulation import micro_batch_sizes
from ..planning.batch_statistics import batch_norm_layers
from ..planning.samples import batch_size_of, items_message, per_sample_items
from ..probe.content_peaks import sparse_momentum_note
from ..probe.train_step import TrainStep, refuse_several

__all__ = ["capped_micro_batch", "checked_micro_batch", "check_optimizer", "warn_growing_momentum", "check_batch_count", "warn_batch_size", "check_checkpoint_dir", "check_data", "check_unbatched_loader", "check_options", "check_split", "model_device", "share_of",
           "warn_batch_statistics"]

log = logging.getLogger("autobatch")


def check_optimizer(optimizer: Any, model: torch.nn.Module) -> None:
    """``Runner(optimizer=)``: one optimizer of ``model``'s parameters (:func:`~autobatch.checks.trains`).
    A list of optimizers (one per learning rate, Lightning's ``configure_optimizers`` list) failed as
    "must be a torch.optim.Optimizer, got list [SGD (Parameter Group 0 ..." with both printed whole;
    one ``TypeError`` naming param groups instead, and what a GAN's several losses do
    (:func:`~autobatch.probe.train_step.refuse_several`). Parameters that require grad but the optimizer
    does not hold (the other optimizer's, left out) got gradients every step, summed over the
    steps and never applied, without a word: one warning naming them."""
    refuse_several(optimizer, "the runner")  # one per learning rate, a GAN's, a dict of them
    checks.trains("optimizer", optimizer, model)
    checks.no_closure("optimizer", optimizer, runner=True)  # LBFGS: the Runner's advice, before TrainStep's (the probe's)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    loose = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if loose:
        log.warning("%d parameters require grad but the optimizer does not hold them (%s%s): they get gradients every "
                    "step, summed over the steps, and are never updated. Add them to the optimizer (a param group of "
                    "their own for another learning rate), or freeze them with requires_grad_(False)", len(loose),
                    ", ".join(loose[:4]), ", ..." if len(loose) > 4 else "")


def warn_growing_momentum(step: TrainStep) -> None:
    """Warn where SGD's momentum on a ``sparse=True`` embedding grows every step (:func:`~autobatch.probe.
    content_peaks.sparse_momentum_note`), the embedding in the runner's model or in its loss module
    (``loss_fn=criterion``, a module the optimizer trains): told of the model's alone before, as
    :func:`check_optimizer`'s warning, so one in the loss module grew without a word."""
    if (growing := sparse_momentum_note(step)) is not None:  # memory that grows every step
        log.warning(growing)


def check_options(device: Any, checkpoint_dir: str | os.PathLike | None, checkpoint_every: int | None, *,
                  writes: bool = True) -> None:
    """``Runner(device=)`` names a device this machine has (as the probe checks it:
    :func:`~autobatch.checks.device_available`), ``checkpoint_every`` (0: off) is a step
    count that comes with the ``checkpoint_dir`` it writes to, and that folder can be written
    where this process ``writes`` checkpoints (rank 0; every rank under FSDP2: :func:`check_checkpoint_dir`).
    ``checkpoint_dir`` is a path: ``5`` or ``True`` (a config's typo) failed in pathlib with "expected str,
    bytes or os.PathLike object, not int", naming no argument, and ``""`` wrote into the working folder."""
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a folder's path (a str or pathlib.Path) or None, got "
                        f"{type(checkpoint_dir).__name__} {checks.shown(checkpoint_dir)}; e.g. checkpoint_dir='runs/exp1' "
                        "(the runner writes last.pt in it), or leave it unset for no checkpoints")
    if isinstance(checkpoint_dir, str) and not checkpoint_dir.strip():
        raise ValueError(f"checkpoint_dir={checkpoint_dir!r} names no folder (it would write last.pt into the working "
                         "folder): give one, e.g. checkpoint_dir='runs/exp1' ('.' for the working folder), or None")
    checks.positive_int("checkpoint_every", checkpoint_every or None, allow_none=True)
    checks.torch_device("device", device)
    checks.device_available("device", device)
    if checkpoint_every and checkpoint_dir is None:
        raise ValueError(f"checkpoint_every={checkpoint_every} needs checkpoint_dir, where the checkpoints are "
                         "written; pass checkpoint_dir=... too, or leave checkpoint_every unset")
    _check_not_a_file_name(checkpoint_dir)
    if writes:
        check_checkpoint_dir(checkpoint_dir)


#: suffixes of checkpoint files, not folders
_FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")


def _check_not_a_file_name(checkpoint_dir: str | os.PathLike | None) -> None:
    """``checkpoint_dir="run/last.pt"`` (a file's name, as Lightning's ``ckpt_path`` is) made a folder
    ``last.pt`` holding ``last.pt``, which ``torch.load("run/last.pt")`` then failed to open
    (``IsADirectoryError``); one ``ValueError`` naming the folder to give instead. A folder of
    that name that exists (made by an earlier run) is taken as it is."""
    if checkpoint_dir is None:
        return
    path = Path(checkpoint_dir).expanduser()
    if path.suffix.lower() in _FILE_SUFFIXES and not path.is_dir():
        raise ValueError(f"checkpoint_dir={str(checkpoint_dir)!r} names a file: it is the folder the runner writes "
                         f"last.pt in; pass checkpoint_dir={str(path.parent)!r} (it writes {path.parent / 'last.pt'})")


def check_kinds(*, balanced: Any, checkpointing_fallback: Any, distributed: Any, progress: Any, log_every: Any,
                faults: Any, no_sync: Any, scheduler: Any, plan_options: Any, optimizer: Any = None) -> dict[str, Any]:
    """The runner's switches, hooks and plan options are of the kind they are used as; returns
    ``plan_options`` as a dict. Before this check ``balanced="no"`` (or ``distributed="false"``, a
    string from a config) read as True; ``faults=[(0, "forward")]`` or ``no_sync=True`` failed at
    the first step with ``'list' object is not callable``; ``scheduler=optimizer`` stepped the
    optimizer a second time each step; a scheduler built on another optimizer (one made again, the
    scheduler left on the old one) changed that one's learning rate, and the run trained at a constant
    rate; a ``plan_options`` key ``plan()`` does not take failed
    after the data's first batch was loaded, naming ``find_max_batch()``, not ``plan_options``."""
    checks.flag("balanced", balanced)
    checks.flag("checkpointing_fallback", checkpointing_fallback)
    checks.flag("distributed", distributed, allow_none=True, none_means="when a process group is active")
    checks.flag("progress", progress, allow_none=True, none_means="when stderr is a terminal")
    checks.count("log_every", log_every, allow_none=True, meaning=" (0 or None: no log lines)")
    for name, value, signature in (("faults", faults, "FaultInjector (or faults(step, phase))"),
                                   ("no_sync", no_sync, "no_sync() -> context manager (e.g. DDP's model.no_sync)")):
        if value is not None:
            checks.function(name, value, signature)
    if isinstance(scheduler, torch.optim.Optimizer):
        raise TypeError(f"scheduler must be an LR scheduler or None, got the optimizer {type(scheduler).__name__} (the "
                        "runner would step it twice a step); pass e.g. torch.optim.lr_scheduler.LambdaLR(optimizer, ...)")
    scheduled = getattr(scheduler, "optimizer", None)  # an LR scheduler's; groups shared where a wrapper holds it
    if (optimizer is not None and isinstance(scheduled, torch.optim.Optimizer)
            and not {id(g) for g in scheduled.param_groups} & {id(g) for g in optimizer.param_groups}):
        raise ValueError(f"scheduler steps another optimizer ({type(scheduled).__name__} at {id(scheduled):#x}) than the "
                         f"runner's ({type(optimizer).__name__} at {id(optimizer):#x}), so it would change that one's "
                         "learning rate and this run's would stay constant: build the scheduler on the optimizer the "
                         "runner is given, e.g. scheduler=torch.optim.lr_scheduler.StepLR(optimizer, ...)")
    return _plan_options(plan_options)


def _plan_options(plan_options: Any) -> dict[str, Any]:
    """``plan_options``: None or a mapping of keyword arguments of ``plan()`` and of the
    ``find_max_batch()`` it calls, but those the runner sets itself."""
    if plan_options is None:
        return {}
    if not isinstance(plan_options, Mapping):
        raise TypeError(f"plan_options must be a dict of plan() keyword arguments or None, got "
                        f"{type(plan_options).__name__} {plan_options!r:.60}; e.g. plan_options={{'memory_limit': '2GiB'}}")
    from ..planning.plan_arguments import plan_keywords, unknown_keyword

    named = plan_keywords() - {"global_batch"}
    for key in plan_options:
        if key == "global_batch":
            raise ValueError("plan_options['global_batch'] is set by the runner: pass Runner(global_batch=...)")
        if key not in named:
            raise TypeError(f"plan_options[{key!r}] {unknown_keyword(key, named)}")  # as plan() says it
    if plan_options.get("memory_limit") is not None:  # here, not at fit() once the data's first batch is loaded
        parse_bytes(plan_options["memory_limit"], name="plan_options['memory_limit']")
    return dict(plan_options)


def check_checkpoint_dir(checkpoint_dir: str | os.PathLike | None) -> None:
    """``checkpoint_dir`` can be written: it, or the nearest folder above it that exists (where it
    will be made), takes a file; else one ``ValueError`` when the runner is made. Without the
    check the first ``save()`` failed, ``checkpoint_every`` steps in, or at the end of the run:
    after all its training, which the error then lost. Nothing is left behind (no folder made)."""
    if checkpoint_dir is None:
        return
    path = existing = Path(checkpoint_dir).expanduser()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.TemporaryFile(dir=existing, prefix=".autobatch-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"checkpoint_dir={str(path)!r} cannot be written ({exc}); the runner writes its checkpoints "
                         "there: give a folder it can create and write, or leave checkpoint_dir unset") from exc


def check_split(share: int, min_micro_batch: int, balanced: bool, per_rank: bool = False) -> None:
    """The global batch (``share``: per rank where ``per_rank``) can be cut into micro-batches of
    at least ``min_micro_batch`` samples at every micro-batch a recovery may shrink to (the
    hardest is ``min_micro_batch`` itself); else one ``ValueError`` naming both, and the floor
    that works."""
    if _splits(share, min_micro_batch, balanced):
        return
    fits = max(floor for floor in range(1, min_micro_batch) if _splits(share, floor, balanced))
    raise ValueError(
        f"global_batch={share}{' per rank' if per_rank else ''} cannot be cut into micro-batches of at least "
        f"min_micro_batch={min_micro_batch} samples and at most one more, as a recovery that shrinks the micro-batch "
        f"to {min_micro_batch} must ({share // min_micro_batch} of {min_micro_batch} leave {share % min_micro_batch} "
        f"over). Lower min_micro_batch to {fits}, or use a global batch that is a multiple of {min_micro_batch}"
    )


def _splits(share: int, floor: int, balanced: bool) -> bool:
    try:
        micro_batch_sizes(share, floor, balanced=balanced, min_micro_batch=floor)
    except ValueError:
        return False
    return True


def check_data(data: Any, share: int | None = None) -> None:
    """``fit(data)``: an iterable of global batches, not one batch. A tensor iterates its rows,
    a dict its keys, and a tuple of tensors sharing dim 0 (an ``(inputs, targets)`` batch) its
    fields: each was trained as a batch of its own; one ``TypeError`` instead. A generator
    function not called (``fit(batches)`` for ``fit(batches())``) and a map-style ``Dataset``
    without its ``DataLoader`` (whose items are samples, not batches) were refused with advice
    to pass ``[batch]``, which neither needs: the error names the call or the loader instead."""
    one_batch = isinstance(data, (torch.Tensor, Mapping)) or _tuple_of_fields(data)
    if not hasattr(data, "__iter__") or one_batch:
        raise TypeError(f"data must be an iterable of global batches (a DataLoader, a list of batches, a generator), "
                        f"got {_data_kind(data, one_batch)}")
    if share is not None:
        check_unbatched_loader(data, share)


def check_unbatched_loader(data: Any, share: int) -> None:
    """Refuse a ``DataLoader(dataset, batch_size=None)`` (no ``batch_sampler``) over a map-style
    ``Dataset`` with its default sampler, whose items are single samples: it yields them one by
    one, unbatched, and the runner read a sample's first dim (its features) as the batch, warned of
    "a batch of 8 samples, not 16", and the model failed on the sample. One ``TypeError`` naming
    ``DataLoader(dataset, batch_size=share)`` instead, decided on ``dataset[0]`` (the index both
    default samplers draw from, read without drawing from their generator): a ``Dataset`` whose items
    are whole batches of ``share`` samples (PyTorch's "loading batched data") trains as before, as
    does an ``IterableDataset`` yielding ready batches or a sampler yielding a batch's indices."""
    samplers = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler)
    if (not isinstance(data, torch.utils.data.DataLoader) or data.batch_size is not None or data.batch_sampler is not None
            or isinstance(data.dataset, torch.utils.data.IterableDataset) or type(data.sampler) not in samplers):
        return
    dataset = data.dataset
    if not hasattr(dataset, "__len__") or len(dataset) == 0:
        return  # no item to read: the run's own error names empty data
    item = data.collate_fn(dataset[0])  # as the loader yields it (default_convert: numpy to tensors)
    try:
        size: int | None = batch_size_of(item)
    except (TypeError, ValueError):  # no batch dimension to read: no batch either
        size = None
    if size != share:
        read = "has no batch dimension" if size is None else f"reads as {counted(size, 'sample')}"
        raise TypeError(
            f"DataLoader(batch_size=None) over the map-style Dataset {type(dataset).__name__} yields its items one by "
            f"one, unbatched, and its first item {read}, not a batch of {share}: batch them, DataLoader(dataset, "
            f"batch_size={share}) (a Dataset whose items are whole batches already: make each {share} samples)")


def _data_kind(data: Any, one_batch: bool) -> str:
    """What ``data`` is, and what to pass instead, for :func:`check_data`'s error."""
    name = getattr(data, "__qualname__", None) or getattr(data, "__name__", None) or type(data).__name__
    if inspect.isgeneratorfunction(data):
        return (f"the generator function {name} itself; call it: fit({name}()) (a generator is used up after one "
                "pass, so for more epochs pass a re-iterable: a DataLoader, a list of batches)")
    if callable(data) and not isinstance(data, (torch.utils.data.Dataset, torch.nn.Module)):
        return f"the callable {name} itself; pass what it returns: fit({name}())"
    if isinstance(data, torch.utils.data.Dataset):
        return (f"the Dataset {type(data).__name__}, whose items are single samples; batch it: "
                "fit(DataLoader(dataset, batch_size=global_batch))")
    return (f"{type(data).__name__}{' of tensors' if one_batch and isinstance(data, tuple) else ''}; "
            "to train on one batch, pass [batch]")


def _tuple_of_fields(data: Any) -> bool:
    """A tuple (a named one too) of tensors that all share their dim 0: one batch's fields."""
    if not isinstance(data, tuple) or not data or not all(isinstance(item, torch.Tensor) for item in data):
        return False
    return all(item.dim() > 0 for item in data) and len({item.shape[0] for item in data}) == 1


def check_batch_count(batch: Any, size: int, share: int) -> None:
    """A batch read as ``size`` samples, not the ``share`` expected, that is a list of ``share``
    entries of one form: per-sample items (``collate_fn=list``: 16 token sequences of 8 read as 8
    samples), not a short batch; one ``ValueError`` naming what to pass instead."""
    if size != share and isinstance(batch, list) and len(batch) == share and per_sample_items(batch):
        raise ValueError(items_message(batch, frozenset({size}), expected=share))


def warn_batch_size(size: int, share: int, multiple_of: int, where: str, world: int = 1) -> None:
    """Warn, once per run, of a batch of ``size`` samples where ``share`` were expected (``where``
    names the rank under torch.distributed, of ``world`` ranks). A larger one gets a hint that dim 0 may not be the
    batch: sequence-first inputs (``(T, B, ...)``, an RNN's default) with ``global_batch=B`` were
    split along time into micro-batches, silently wrong for the model. One of the whole global
    batch on a rank (``DataLoader(batch_size=global_batch)`` over a ``DistributedSampler``) is named as that."""
    ragged = (f" (no multiple of multiple_of={multiple_of}: one of its micro-batches is not one either; "
              "drop_last=True avoids it)") if size % multiple_of else ""
    if world > 1 and size == share * world:  # trained world x global_batch samples a step, with a hint about dim 0
        ragged += (f"; global_batch={size} is global, over {world} ranks, and these steps train {size * world} samples: "
                   f"each rank's DataLoader yields its share, DataLoader(dataset, batch_size={share}, "
                   "sampler=DistributedSampler(dataset))")
    elif size > share:
        ragged += ("; the runner splits and counts samples along dim 0: if dim 0 is not the batch (sequence-first "
                   "inputs, (T, B, ...)), make the batches batch-first (batch_first=True, .transpose(0, 1))")
    log.warning("%sa batch of %d samples, not %d%s; each step uses its own batch's size", where, size, share, ragged)


def checked_micro_batch(micro_batch: Any, global_batch: int) -> int | None:
    """``Runner(micro_batch=)``: a positive integer or None. A :class:`~autobatch.Plan` (or its
    ``to_dict()``, a CLI run's ``plan.json`` loaded) failed as "must be a positive integer, got
    Plan(...)" with the whole plan printed and no word of how a plan is used; one ``TypeError``
    naming ``micro_batch=plan.micro_batch``, the ``plan.apply(model)`` a checkpointed plan needs
    first, and the plan's own global batch where it is not the runner's. A plan is not taken as
    it is: applying its checkpointing to the model is the caller's step, as for every plan."""
    fields = micro_batch.to_dict() if hasattr(micro_batch, "to_dict") and hasattr(micro_batch, "micro_batch_sizes") else (
        micro_batch if isinstance(micro_batch, Mapping) and "micro_batch" in micro_batch else None)
    if fields is None:
        return checks.positive_int("micro_batch", micro_batch, allow_none=True)
    steps = []
    active = [handle for handle in [getattr(micro_batch, "handle", None), *getattr(micro_batch, "applied", [])]
              if handle is not None and handle.active]
    if fields.get("checkpointing") and not active:  # plan() turned it on in the planned model already
        steps.append("call plan.apply(model) first (its micro-batch was measured with activation checkpointing on "
                     f"{counted(len(fields.get('checkpointed_modules') or []), 'module')}; plan.from_dict does not turn it on)")
    if fields.get("global_batch") not in (None, global_batch):
        steps.append(f"this plan is for {fields['global_batch']} samples a step, not global_batch={global_batch}: plan "
                     "for the runner's batch (per rank under torch.distributed), or pass global_batch=plan.global_batch")
    if fields.get("balanced") is False:
        steps.append("pass balanced=False as the plan split")
    kind = "a plan's dict" if isinstance(micro_batch, Mapping) else "a Plan"
    raise TypeError(f"micro_batch takes the samples per forward/backward, got {kind}: pass "
                    f"micro_batch=plan.micro_batch ({fields.get('micro_batch')!r})" + "".join(f"; {step}" for step in steps)
                    + "; or leave micro_batch=None and the runner plans it on its data (plan_options go to plan())")


def capped_micro_batch(micro_batch: int | None, share: int, per_rank: bool = False) -> int | None:
    """``Runner(micro_batch=)`` capped at the global batch (``share``: per rank where ``per_rank``):
    a step is never more than its batch. One warning where it is above it: a probe's answer (more
    fits than a step holds) trains the same capped, but so did arguments swapped
    (``global_batch=8, micro_batch=16`` meant 16 samples a step) or a per-rank share misread, without
    a word, at half the batch the user meant. The command line refuses its own ``train.micro_batch``
    above the share and passes its probe's answers capped already."""
    if micro_batch is None or micro_batch <= share:
        return micro_batch
    log.warning("micro_batch=%d is above the global batch%s (%d samples a step): each step trains as one micro-batch "
                "of %d. If you meant %d samples a step, raise global_batch; else pass micro_batch=%d (a probe's "
                "answer: min(answer, global batch)) to silence this", micro_batch, " per rank" if per_rank else "",
                share, share, micro_batch, share)
    return share


def share_of(global_batch: int, world: int) -> int:
    """This rank's samples per step: ``global_batch`` split evenly over the ``world`` ranks."""
    if global_batch % world:
        raise ValueError(f"global_batch={global_batch} does not split evenly over {world} ranks; use a multiple of {world}")
    return global_batch // world


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without one)."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def warn_batch_statistics(model: torch.nn.Module, sizes: list[int]) -> bool:
    """Warn, once a step trains in several micro-batches (``sizes``), where ``model`` has BatchNorm
    layers in training mode: each piece is normalised with its own statistics, so the step's
    gradients and running statistics are not those of one batch (GroupNorm and LayerNorm do not
    depend on the batch), and an OOM recovery's smaller pieces change them again. The
    accumulation of every other loss is exact, so this is the one place the split shows.
    Returns whether it warned."""
    shown = batch_norm_layers(model)
    if shown is None:
        return False
    log.warning(
        "BatchNorm layers in training mode (%s) normalise each micro-batch with its own statistics: this step's "
        "micro-batches of %s train otherwise than one batch of %d would (gradients and running statistics; "
        "GroupNorm and LayerNorm do not depend on the batch), as an OOM recovery's smaller ones do again; "
        "Runner(min_micro_batch=N) keeps every piece at N or more", shown, _sizes_text(sizes), sum(sizes),
    )
    return True


def _sizes_text(sizes: list[int]) -> str:
    distinct = sorted(set(sizes), reverse=True)
    return " and ".join(map(str, distinct)) if len(distinct) <= 2 else f"{distinct[0]} down to {distinct[-1]}"


#: peers' names for the Runner's keywords (Lightning's, Transformers'), suggested where given
RUNNER_ALIASES = {"batch_size": "global_batch", "micro_batch_size": "micro_batch", "gradient_accumulation_steps": "micro_batch",
                  "accumulate_grad_batches": "micro_batch", "gradient_clip_val": "max_grad_norm", "scaler": "grad_scaler",
                  "lr_scheduler": "scheduler", "precision": "autocast_dtype", "checkpoint_path": "checkpoint_dir",
                  # a checkpoint or log period's peer names: by spelling alone, save_steps was "did you mean 'steps'?"
                  # (which ends the run there) and save_every "did you mean 'log_every'?"
                  "save_steps": "checkpoint_every", "save_every": "checkpoint_every", "every_n_train_steps": "checkpoint_every",
                  "logging_steps": "log_every", "log_interval": "log_every", "output_dir": "checkpoint_dir",
                  "enable_progress_bar": "progress", "disable_tqdm": "progress"}
#: ``plan()``'s and the probe's keywords that a Runner takes in ``plan_options`` (the memory budget's
#: ``memory_limit`` above all), told where they go where passed to the Runner itself
RUNNER_PLAN_KEYWORDS = {key: "plan_options" for key in ("memory_limit", "margin", "strategy", "objective", "cache",
                                                        "estimate_first", "allow_accumulation", "allow_checkpointing")}
#: the same for ``Runner.fit``
FIT_ALIASES = {"max_epochs": "epochs", "num_epochs": "epochs", "num_train_epochs": "epochs", "max_steps": "steps",
               "ckpt_path": "resume", "resume_from_checkpoint": "resume", "train_dataloader": "data",
               "train_dataloaders": "data", "dataloader": "data", "callback": "on_step_end"}
