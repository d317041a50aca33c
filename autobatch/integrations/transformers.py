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
import numbers
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch

from .. import checks
from ..probe.find import find_max_batch
from ..probe.result import ProbeResult
from .global_batch import cap_at_samples, check_share, small_split, split_keeping
from .transformers_resume import resumed_global_batch, warn_unseen_resume
from .transformers_step import TrainerStep, checkpointing_as_train, trainer_key

__all__ = ["fit_batch_size", "longest_sample"]

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
            :func:`longest_sample` of the training set, which reads every sample once, a
            🤗 ``datasets.Dataset`` a thousand rows a slice; a stream's first 1,000).

    Returns the :class:`~autobatch.ProbeResult`; ``trainer.args`` holds the new settings. The
    model's train/eval mode (each module's) is as it was before the call.
    """
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1)))
    _refuse_data_parallel(args)
    if "probe_options" in probe_options:  # AutoBatchSize's spelling: here they are keywords
        raise TypeError(f"fit_batch_size takes find_max_batch's options as keywords (fit_batch_size(trainer, "
                        f"cache=False)), not as probe_options=...; pass **{probe_options['probe_options']!r:.60}")
    global_batch, multiple_of, max_batch = _check_sizes(global_batch, multiple_of, max_batch, world)
    asked = global_batch
    global_batch = resumed_global_batch(trainer, resume_from_checkpoint, global_batch, world, multiple_of)
    _refuse_auto_find(args, global_batch)
    share = None if global_batch is None else global_batch // world
    start = probe_options.pop("start", None)
    max_batch, start = cap_at_samples(share, max_batch, start, multiple_of, where=f"global_batch={global_batch}")
    shard = _shard_length(trainer.train_dataset, world)
    if shard is not None and share is not None and share > shard:
        raise ValueError(  # an epoch would end first: every optimizer step would train fewer samples
            f"global_batch={global_batch} is larger than the training set ({shard * world} samples"
            f"{f', {shard} per process' if world > 1 else ''}): each epoch would end before one global batch; "
            "lower global_batch"
        )
    # no batch larger than a process's share of the training set
    max_batch, start = cap_at_samples(shard, max_batch, start, multiple_of,
                                      where=f"the training set{f' (a process of {world})' if world > 1 else ''}")
    if sample is None and trainer.train_dataset is None:  # an eval-only Trainer: sample= would size training
        raise ValueError("fit_batch_size sizes training and trainer.train_dataset is None: give the Trainer its train_dataset, or pass "
                         "sample=. It does not size evaluation: for trainer.evaluate() alone, set per_device_eval_batch_size yourself")
    sample = longest_sample(trainer.train_dataset) if sample is None else sample
    # without a global batch, the trainer's own accumulation stays: its window is probed
    accumulation = 1 if share is not None else max(1, int(args.gradient_accumulation_steps))
    # the Trainer's loop trains the answer, and it cannot replay a step that runs out of memory
    options = {"hand_loop": True, **probe_options, "start": start}
    modes = [(module, module.training) for module in trainer.model.modules()]
    created = trainer.optimizer is None
    try:
        step = _train_step(trainer, sample, share, accumulation)
        # what the step holds beside the model (the window's inputs, the stand-in for DDP's buckets,
        # a subclass's own step) moves the answer
        options["cache_key"] = {"trainer": trainer_key(trainer), "share": share, "accumulation": accumulation,
                                "ddp_buckets": step.bucket_bytes, "user": options.get("cache_key")}
        result = find_max_batch(step, max_batch=max_batch, memory_limit=memory_limit, margin=margin,
                                multiple_of=multiple_of, strategy=strategy, steps_per_trial=steps_per_trial,
                                device=args.device, **options)
    finally:
        if created:
            trainer.optimizer = None  # train() creates it afresh, as it would have
        for module, training in modes:  # a model in eval() stays in eval(): train() switches it itself
            module.training = training
    size = result.batch_size
    if share is not None:
        accumulation, size = _split(global_batch, world, size, multiple_of, asked is not None, args.gradient_accumulation_steps)
        args.gradient_accumulation_steps = accumulation
    args.per_device_train_batch_size = size
    trainer._train_batch_size = args.train_batch_size  # Trainer copies it at construction
    if asked is None and resume_from_checkpoint is None and getattr(args, "resume_from_checkpoint", None) is None:
        warn_unseen_resume(trainer, size)
    log.info("fit_batch_size: per_device_train_batch_size=%d, gradient_accumulation_steps=%d: %d samples per "
             "optimizer step over %d process(es) (probe %d)%s", size, accumulation, size * accumulation * world,
             world, result.batch_size, "" if share is not None else "; pass global_batch= to keep a global batch")
    return result


def _split(global_batch: int, world: int, largest: int, multiple_of: int, asked: bool, given: int) -> tuple[int, int]:
    """``(accumulation, per-device batch)`` for a process's share of ``global_batch``. Where
    ``asked`` (the global batch is the caller's, not one a resumed checkpoint's samples per step
    gave, which this run's accumulation already makes up): the user's ``gradient_accumulation_steps``
    (``given``) is kept where it splits the share into batches that fit, else replaced with one
    warning naming both (:func:`.global_batch.split_keeping`), and a share with no divisor near
    ``largest`` is one warning (many small micro-batches a step; :func:`.global_batch.small_split`)."""
    given = int(given) if asked else None
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


#: samples read from a training set without a length (a stream) in search of the longest
STREAM_SAMPLES = 1000
#: rows a columnar dataset's slice reads at a time (:func:`_rows_by_slice`)
SLICE_ROWS = 1000


def longest_sample(dataset: Any) -> Any:
    """The worst-case sample: each field at its longest over the training set, as a padded
    batch can meet them. A collator pads every field to its own longest in the batch, so a
    batch may pair one sample's long source with another's long target (seq2seq): the probe's
    sample takes each field from wherever it is longest, measured by its padded size (a
    multiple-choice sample's choices count as choices x their longest). Fields of the same
    length in every sample (token ids and their attention mask) stay the same length.

    A sample is a record of fields when it is a mapping (by key) or a tuple (by position); any
    other sample (a list of token ids, a tensor) is one field, and the largest one is kept.
    Text counts its characters, for a collator that tokenizes it (a chat: messages x the longest).
    Where the samples cannot be compared (a tuple's or a lone sample's image or other object,
    samples of different structures), this warns and returns the first: pass ``sample=`` (your
    longest) then. A mapping's field of such a kind is taken from the first sample.

    A map-style dataset is read by index over its length, once (a columnar one, such as a 🤗
    ``datasets.Dataset``, a thousand rows a slice). A dataset without a length
    (an ``IterableDataset``, maybe endless) is read for its first :data:`STREAM_SAMPLES`
    samples only, with a warning: pass ``sample=`` to probe at the longest one yourself, and
    always for a stream that cannot be read twice (the samples read here would be gone when
    ``train()`` reads it)."""
    items = _samples(dataset)
    first = next(items, _EMPTY)
    if first is _EMPTY:
        raise ValueError("fit_batch_size: the training set is empty")
    best: dict[Any, Any] = {}
    sizes: dict[Any, int] = {}
    for index, item in enumerate(itertools.chain([first], items)):
        fields = _fields(item, first)
        if isinstance(fields, str):
            log.warning("fit_batch_size: cannot tell the longest sample of the training set (sample %d: %s); probing "
                        "at the first sample, which a longer one may not fit beside; pass sample= (your longest "
                        "sample, as the dataset yields it)", index, fields)
            return first
        for key, value in fields:
            size = _padded_size(value)
            if size > sizes.get(key, -1):
                best[key], sizes[key] = value, size
    return _rebuilt(first, best)


_EMPTY = object()


def _samples(dataset: Any) -> Iterator[Any]:
    """The samples :func:`longest_sample` reads, a bounded number: a map-style dataset by index
    over its length (iterating one runs ``__getitem__`` until it raises ``IndexError``, which a
    synthetic or wrapping dataset never does); a stream by iteration, up to its length or,
    without one, up to :data:`STREAM_SAMPLES` (with a warning)."""
    try:
        length = len(dataset)
    except TypeError:
        log.warning("fit_batch_size: the training set has no length (a stream); probing at the longest of its first "
                    "%d samples, which this reads; pass sample= (your longest sample) if a later one is longer, and "
                    "always for a stream that cannot be read twice", STREAM_SAMPLES)
        return itertools.islice(iter(dataset), STREAM_SAMPLES)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return itertools.islice(iter(dataset), length)
    if length and isinstance(getattr(dataset, "column_names", None), list):
        return _rows_by_slice(dataset, length)
    return (dataset[index] for index in range(length))


def _rows_by_slice(dataset: Any, length: int) -> Iterator[Any]:
    """A columnar dataset's rows (🤗 ``datasets.Dataset``: ``column_names``, and a slice gives a
    mapping of columns), read :data:`SLICE_ROWS` at a time: what ``dataset[i]`` gives, as that
    slice's ``i``-th value of each column. Measured here (CPU, 100,000 tokenized rows,
    ``datasets`` 5.2): :func:`longest_sample` in 1.3 s, where one ``dataset[i]`` a row took 2.7 s.
    Where the first slice is no such mapping of ``dataset[0]``'s fields, row by row."""
    batch = dataset[0:SLICE_ROWS]
    first = dataset[0]
    rows = min(SLICE_ROWS, length)
    if not (isinstance(batch, Mapping) and isinstance(first, Mapping) and list(batch) == list(first)
            and all(isinstance(column, Sized) and len(column) == rows for column in batch.values())):
        yield from (dataset[index] for index in range(length))
        return
    for start in range(0, length, SLICE_ROWS):
        batch = batch if start == 0 else dataset[start:start + SLICE_ROWS]
        keys = list(batch)
        for values in zip(*(batch[key] for key in keys)):
            yield dict(zip(keys, values))


def _fields(item: Any, first: Any) -> list[tuple[Any, Any]] | str:
    """``item``'s ``(key, value)`` fields, shaped as ``first``'s: a mapping's items, a tuple's
    positions, or the whole sample as one field; a string saying why not where ``item`` cannot be
    compared with ``first`` (another structure, or a value with no padded size)."""
    if isinstance(first, Mapping):
        if not isinstance(item, Mapping):
            return f"a {type(item).__name__} among {type(first).__name__} samples"
        return list(item.items())  # a column of another kind (an id object) is the collator's to drop
    if isinstance(first, tuple):
        if not isinstance(item, tuple) or len(item) != len(first):
            return f"a {type(item).__name__} of {_length(item)} among tuples of {len(first)}"
        fields = list(enumerate(item))
    elif isinstance(item, (Mapping, tuple)):
        return f"a {type(item).__name__} among {type(first).__name__} samples"
    else:
        fields = [(None, item)]
    unknown = [value for _, value in fields if not _measurable(value)]
    return f"a {type(unknown[0]).__name__} has no padded size" if unknown else fields


def _length(item: Any) -> str:
    try:
        return str(len(item))
    except TypeError:
        return "no length"


def _rebuilt(first: Any, best: dict[Any, Any]) -> Any:
    """The worst-case sample in ``first``'s structure, from its fields at their longest."""
    if isinstance(first, Mapping):
        return type(first)(best) if type(first) is not dict and _rebuildable(first) else dict(best)
    if isinstance(first, tuple):
        values = [best[index] for index in range(len(first))]
        return type(first)._make(values) if hasattr(type(first), "_make") else tuple(values)
    return best[None]


def _measurable(value: Any) -> bool:
    """Whether :func:`_padded_size` knows what ``value`` takes in a padded batch."""
    return value is None or isinstance(value, (numbers.Number, torch.Tensor, Sequence, Mapping)) or _is_array(value)


def _is_array(value: Any) -> bool:
    """An array of another library (NumPy's): an integer ``ndim`` and element count ``size``."""
    return isinstance(getattr(value, "ndim", None), int) and isinstance(getattr(value, "size", None), int)


def _padded_size(value: Any) -> int:
    """The elements ``value`` takes once padded: a sequence's length, a nested sequence's
    outer length times its longest inner one, a tensor's (or array's) element count; 0 for a
    scalar; text its characters, the best guess at its tokens without the tokenizer (as 0, the
    first sample's text was probed: a short one answered 64, and train() ran out of memory)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):  # a chat message ({"role": ..., "content": ...}): its text together
        return sum(_padded_size(v) for v in value.values())
    if isinstance(value, torch.Tensor):
        return int(value.numel()) if value.dim() else 0
    if _is_array(value):
        return int(value.size) if value.ndim else 0
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if not value or isinstance(value[0], numbers.Number):  # flat (token ids, a mask): no element to look into
            return len(value)
        inner = [_padded_size(v) for v in value if isinstance(v, (Sequence, Mapping, torch.Tensor)) or _is_array(v)]
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


def _train_step(trainer: Any, sample: Any, share: int | None, accumulation: int) -> TrainerStep:
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
    return TrainerStep(trainer, sample, share, accumulation)
