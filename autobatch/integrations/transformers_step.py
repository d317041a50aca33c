"""One optimizer step of a ``transformers.Trainer``'s loop, as the probe's unit of work.

:func:`~autobatch.integrations.transformers.fit_batch_size` probes this step, not a bare
forward and backward, because the ``Trainer``'s loop holds memory a bare step does not
(``Trainer._run_epoch``, transformers 5; measured on the CPU's simulated device, where a
ViT's bare-step answer ran out of memory in ``train()`` five sizes below it):

* **The inputs of the whole optimizer step.** ``get_batch_samples`` fetches every micro-batch
  of a gradient-accumulation window onto the device before the first forward, and the list
  keeps each alive until the optimizer has stepped: a process's whole share of the global
  batch (``share``), where a bare step lets its one micro-batch go after forward. For images
  that is not small: 512 samples of 224 x 224 float pixels are 308 MB.
* **The accelerate loader's look-ahead.** ``DataLoaderShard`` fetches the next batch before
  yielding the current one: host memory on an accelerator, the same memory on the CPU.
* **The earlier micro-batches' gradients** alive through the later ones' forward and backward
  (as :class:`~autobatch.planning.accumulation.AccumulatingStep` probes an accumulated plan).
* **The forward Accelerate prepares.** Under native mixed precision ``prepare_model`` wraps
  the model's forward in autocast and converts its outputs to fp32
  (``convert_outputs_to_fp32``): a float copy of every half-precision output, a language
  model's logits among them, that a bare ``torch.autocast`` never makes.
* **The ``Trainer``'s own ``training_step``** (its ``compute_loss``, a subclass's override,
  ``accelerator.backward`` with its grad scaler) and gradient clipping at ``max_grad_norm``,
  passed the ``num_items_in_batch`` ``train()`` counts over the window (a ``compute_loss_func``
  that divides by it fails without it).
* **DDP's gradient buckets, on the CPU.** Over several processes ``train()`` wraps the model in
  ``DistributedDataParallel`` (Accelerate's ``prepare_model``), and the probe runs the model
  unwrapped (a collective in a trial would wait on peers whose searches run other trials).
  Over CPU processes (gloo) the wrapped step holds buckets as large as the trainable
  parameters beyond the unwrapped one's, so there each trial holds a stand-in of that size
  through its step (:func:`ddp_bucket_bytes`): on the simulated device (2 processes, a
  1.6 M-parameter GPT-2, 32 MiB) the unwrapped answer, 5, ran out of memory in ``train()``'s
  first step; with the stand-in 2 trains and 3 does not. Over CUDA processes the ``Trainer``'s
  DDP step peaked where the unwrapped trials did (2 x H200, 12 GiB: GPT-2 small at 22 and
  ViT-B/16 at 124, within 10 MiB, with ``ddp_find_unused_parameters`` on and off), and the
  unwrapped answers were the exact maxima under DDP (23 and 125 ran out of memory), where a
  stand-in answered 21 and 121 (``scripts/gpu_hf_ddp.py``): no stand-in there.

A trial at batch ``B`` runs the first two micro-batches of ``B`` where the ``Trainer`` would
accumulate (``share`` > ``B``), holding the inputs of ``max(share, 2B)`` samples; the
``Trainer`` then runs micro-batches of at most ``B`` (:func:`~autobatch.integrations.global_batch.accumulation_for`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ContextManager

import torch

from ..probe.caching.cache_key import own_code
from ..probe.train_step import TrainStep
from ..training.batch_ops import to_device
from .transformers_padding import padded_length
from .trial_settings import sized_for_trial

__all__ = ["TrainerStep", "checkpointing_as_train", "checkpointing_settings", "ddp_bucket_bytes", "num_items_in_batch",
           "trainer_key", "training_collator"]


class TrainerStep(TrainStep):
    """``fn(batch_size)``: one optimizer step of ``trainer``'s loop on batches its data collator
    builds from ``sample`` (module description); ``share`` is this process's samples per
    optimizer step (None: no accumulation). A :class:`~autobatch.TrainStep`, so the probe
    restores the model, the optimizer and the accelerator's grad scaler."""

    def __init__(self, trainer: Any, sample: Any, share: int | None, accumulation: int = 1, short: Any = None) -> None:
        self.trainer, self.sample, self.share, self.accumulation = trainer, sample, share, accumulation
        self.short = short  # a shorter sample the collator pads, as train()'s batches (transformers_samples.probe_samples)
        #: the model's main input, and its length in the last probed batch of two samples or more
        #: (:mod:`~autobatch.integrations.transformers_padding`; the cache key builds one too, fake or real)
        self.main, self.padded = getattr(trainer.model, "main_input_name", None) or "input_ids", None
        self.collate = training_collator(trainer)
        max_grad_norm = getattr(trainer.args, "max_grad_norm", None)
        self.bucket_bytes = ddp_bucket_bytes(trainer)
        super().__init__(trainer.model, trainer.optimizer, self._loss, self._device_batch,
                         grad_scaler=getattr(trainer.accelerator, "scaler", None),
                         max_grad_norm=max_grad_norm if max_grad_norm and max_grad_norm > 0 else None)

    def _host_batch(self, size: int) -> Any:
        samples = [self.sample] * size
        if self.short is not None and size > 1:
            samples[-1] = self.short  # padded, with the attention mask train()'s padded batches carry
        batch = self.collate(samples)
        if size > 1:
            self.padded = padded_length(batch, self.main)
        return batch

    def _device_batch(self, size: int) -> Any:
        return to_device(self._host_batch(size), self.trainer.args.device)

    def _loss(self, model: Any, batch: Any) -> Any:
        """The ``Trainer``'s loss on ``batch`` (what estimates trace and the cache key reads),
        normalised by ``num_items_in_batch`` where ``train()`` passes one."""
        items = num_items_in_batch(self.trainer, [batch])
        extra = {} if items is None else {"num_items_in_batch": items}
        with self.trainer.accelerator.autocast(), self.trainer.compute_loss_context_manager():
            return self.trainer.compute_loss(model, batch, **extra)

    def window(self, batch_size: int) -> tuple[int, int]:
        """``(micro-batches run, samples whose inputs are held)`` of a trial at ``batch_size``:
        with ``share``, the window of micro-batches of at most ``batch_size`` that make it up;
        else ``accumulation`` micro-batches of ``batch_size`` (the trainer's own setting)."""
        if self.share is not None:
            micro = 1 if batch_size >= self.share else 2
            return micro, max(self.share, micro * batch_size)
        return min(self.accumulation, 2), self.accumulation * batch_size

    def __call__(self, batch_size: int) -> None:
        with _trial_size(self.trainer, batch_size):
            self._step(batch_size)

    def _step(self, batch_size: int) -> None:
        micro, held_samples = self.window(batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP's buckets, allocated before the step as train()'s exist before its first
        buckets = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.trainer.args.device) \
            if self.bucket_bytes else None
        batches = [self._device_batch(batch_size) for _ in range(micro)]
        rest = held_samples - micro * batch_size  # the window's other micro-batches, fetched too
        held = self._device_batch(rest) if rest > 0 else None
        ahead = self._host_batch(batch_size)  # the loader's look-ahead
        # train() counts the window's tokens once and passes the count to each micro-batch's step
        extra = [num_items_in_batch(self.trainer, batches + ([held] if held is not None else []))]
        extra = extra if _takes_num_items(self.trainer.training_step) else []
        with prepared_forward(self.trainer), _accumulating(self.trainer, micro):
            for inputs in batches:
                self.trainer.training_step(self.model, inputs, *extra)
        self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        del batches, held, ahead, buckets


def _trial_size(trainer: Any, batch_size: int) -> ContextManager[None]:
    """``trainer.args.per_device_train_batch_size`` and ``trainer._train_batch_size`` (what
    ``train()`` batches at, where set) at ``batch_size`` while a trial runs, each put back after
    it (:mod:`~autobatch.integrations.trial_settings`): a ``compute_loss`` override that reads the
    size (per-example weights, contrastive labels: ``torch.ones(self.args.per_device_train_batch_size)``)
    got the user's own size in a trial of another."""
    places = [(trainer.args, "per_device_train_batch_size")]
    if trainer.__dict__.get("_train_batch_size") is not None:
        places.append((trainer, "_train_batch_size"))
    return sized_for_trial(places, batch_size)


def ddp_bucket_bytes(trainer: Any) -> int:
    """The bytes a trial holds for the gradient buckets of the ``DistributedDataParallel`` that
    ``train()`` wraps ``trainer.model`` in over several CPU processes (Accelerate's
    ``MULTI_CPU``): the trainable parameters' bytes, one bucket slot per trainable element in
    its dtype; 0 elsewhere. Over GPU processes the ``Trainer``'s DDP step measured no more than
    the unwrapped step (module description); FSDP, DeepSpeed, XLA and tensor parallelism
    reduce gradients their own way; a model already wrapped is measured as it is."""
    accelerator = getattr(trainer, "accelerator", None)
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", "")
    parallelism = getattr(accelerator, "parallelism_config", None)
    if (kind != "MULTI_CPU" or int(getattr(trainer.args, "world_size", 1) or 1) <= 1
            or getattr(parallelism, "tp_enabled", False)
            or isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)):
        return 0
    return sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)


def num_items_in_batch(trainer: Any, batches: list[Any]) -> Any:
    """What ``train()`` passes ``training_step`` as ``num_items_in_batch`` for an optimizer step
    over ``batches``: the label tokens a ``compute_loss_func`` (or a model taking loss kwargs)
    divides the loss by, counted by the trainer's own ``get_batch_samples`` (a subclass's
    override too; transformers 4.46 on, its ``device`` argument when it takes one); None where the
    trainer counts none, or has no such method (older transformers pass none).

    A count over processes (``average_tokens_across_devices``) is taken as this process's count
    times the world size, not gathered: every process probes the same batches, and a trial must
    not wait on a collective its peers may not run (processes' searches run different trials)."""
    count = getattr(trainer, "get_batch_samples", None)
    if count is None:
        return None
    device = [trainer.args.device] if _positional_arguments(count) >= 3 else []
    with _gathered_locally(trainer):
        _, items = count(iter(batches), len(batches), *device)
    return items


def _positional_arguments(function: Any) -> int:
    """How many positional arguments ``function`` takes (a large number for ``*args``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it as the oldest API
        return 0
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return sys.maxsize
    return sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
               for p in parameters)


def _takes_num_items(training_step: Any) -> bool:
    """Whether ``training_step`` takes ``num_items_in_batch`` (third, as ``train()`` passes it:
    transformers 4.46 on; an override written for an older one does not)."""
    return _positional_arguments(training_step) >= 3


@contextmanager
def _gathered_locally(trainer: Any) -> Iterator[None]:
    """``trainer.accelerator.gather`` for the duration, over several processes, as every process
    holding this one's tensor: the sum a gather of identical batches gives, with no collective."""
    accelerator, world = trainer.accelerator, int(getattr(trainer.args, "world_size", 1) or 1)
    if world <= 1:
        yield
        return
    own = accelerator.__dict__.get("gather")
    accelerator.gather = lambda tensor: torch.cat([tensor.reshape(-1) if tensor.dim() == 0 else tensor] * world)
    try:
        yield
    finally:
        if own is None:
            del accelerator.gather
        else:
            accelerator.gather = own


def training_collator(trainer: Any) -> Any:
    """The collator ``train()`` batches with: the data collator behind the ``Trainer``'s removal
    of the columns the model's forward does not take (``remove_unused_columns``, the default),
    which a raw collator chokes on (a ``text`` column beside the token ids)."""
    collator = trainer.data_collator
    remove = getattr(trainer, "_get_collator_with_removed_columns", None)
    if getattr(trainer.args, "remove_unused_columns", False) and remove is not None:
        return remove(collator, description="training")
    return collator


@contextmanager
def _accumulating(trainer: Any, micro: int) -> Iterator[None]:
    """``trainer.current_gradient_accumulation_steps``, which ``training_step`` divides the loss
    by, set for the trial (``_run_epoch`` sets it per window) and put back after."""
    missing = object()
    previous = getattr(trainer, "current_gradient_accumulation_steps", missing)
    trainer.current_gradient_accumulation_steps = micro
    try:
        yield
    finally:
        if previous is missing:
            del trainer.current_gradient_accumulation_steps
        else:
            trainer.current_gradient_accumulation_steps = previous


@contextmanager
def prepared_forward(trainer: Any) -> Iterator[None]:
    """The model's forward as ``trainer.train()`` runs it, for the duration: under native mixed
    precision Accelerate's ``prepare_model`` wraps it in autocast and converts its outputs to
    fp32; a model Accelerate already prepared (``_original_forward``) is left as it is."""
    model, accelerator = trainer.model, trainer.accelerator
    if not getattr(accelerator, "native_amp", False) or hasattr(model, "_original_forward"):
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    own = model.__dict__.get("forward")
    context = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    model.forward = convert_outputs_to_fp32(context(model.forward))
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def checkpointing_settings(args: Any) -> dict[str, Any] | None:
    """The activation (gradient) checkpointing ``train()`` switches on, as the keyword arguments
    of the model's switch; None where it switches none. transformers 5 names the setting
    ``activation_checkpointing`` (``gradient_checkpointing`` before, kept as an alias)."""
    if not (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)):
        return None
    return dict(getattr(args, "activation_checkpointing_kwargs", None)
                or getattr(args, "gradient_checkpointing_kwargs", None) or {})


def checkpointing_as_train(trainer: Any) -> None:
    """Switch activation checkpointing on as ``train()`` will, before the probe: a probe without
    it answered 8 where ``train()`` with it trained 14. A model with only the deprecated
    ``gradient_checkpointing_enable`` gets ``every_n_layers`` and ``offload`` too where they are set, as
    ``train()`` passes them (without, the probe would checkpoint every layer where ``train()``
    checkpoints every second one, and answer above what trains)."""
    kwargs, model = checkpointing_settings(trainer.args), trainer.model
    if kwargs is None:
        return
    every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                                              offload=offload)
    elif hasattr(model, "gradient_checkpointing_enable"):  # outside PreTrainedModel (any model before transformers 5)
        # train() passes every_n_layers and offload too; only where set, as transformers 4's method takes neither
        extra = {name: value for name, value, default in (("every_n_layers", every, 1), ("offload", offload, False))
                 if value != default}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **extra)


def trainer_key(trainer: Any) -> str:
    """What of ``trainer`` the probe cache keys on beside the model, as one digest: its own
    class's code (a subclass's ``compute_loss`` or ``training_step``; ``Trainer``'s by the
    transformers version), the mixed precision, the clipping, gradient checkpointing and the
    column removal."""
    own = []
    for cls in type(trainer).__mro__:
        if cls.__module__.split(".")[0] == "transformers":
            break
        own.append([cls.__qualname__, own_code(cls)])
    transformers = sys.modules.get("transformers")
    args = trainer.args
    parts = {"classes": own, "transformers": getattr(transformers, "__version__", None),
             "mixed_precision": str(getattr(trainer.accelerator, "mixed_precision", None)),
             "max_grad_norm": getattr(args, "max_grad_norm", None),
             "checkpointing": checkpointing_settings(args),
             "remove_unused_columns": getattr(args, "remove_unused_columns", None)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()
