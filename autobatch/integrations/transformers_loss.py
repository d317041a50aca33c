"""Whether a ``transformers.Trainer``'s accumulated steps average their gradients, checked once by
:func:`~autobatch.integrations.transformers.fit_batch_size` where the split it sets accumulates.

The ``Trainer`` divides each micro-batch's loss by ``gradient_accumulation_steps`` unless it takes
the model to normalise the loss itself (``model_accepts_loss_kwargs``: the model has
``accepts_loss_kwargs``, or a ``**kwargs`` forward), in which case it passes the window's
``num_items_in_batch`` and divides by nothing. A model that takes ``**kwargs`` but computes its loss
as a plain mean, ignoring ``num_items_in_batch``, then has each optimizer step's gradient summed
over the window: ``gradient_accumulation_steps`` times the mean. Measured (transformers 5.24, tiny
T5 and BART from config, ``DataCollatorForSeq2Seq``, SGD, no clipping): 8 x 2 moved the weights
2.0x as far as 16 x 1 from the same start, and the logged ``train_loss`` doubled; GPT-2 (which
honours ``num_items_in_batch``) moved them alike. Splitting a ``global_batch`` into accumulated
micro-batches therefore silently multiplied the learning rate for such a model. The same holds for a
``Trainer`` subclass's ``compute_loss`` (or a ``compute_loss_func``) that takes a plain mean: the
``Trainer`` divides by nothing there either, so the loss checked is ``trainer.compute_loss``'s, not
the model's (a GPT-2 under such an override stepped 2.02x the gradient at 8 x 2, unwarned).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..training.batch_ops import to_device
from .transformers_step import num_items_in_batch, training_collator

__all__ = ["ignores_num_items", "warn_unscaled_accumulation"]

log = logging.getLogger("autobatch")


def ignores_num_items(trainer: Any, sample: Any) -> bool:
    """Whether the loss ``train()`` trains, ``trainer.compute_loss`` (the model's own loss, a
    subclass's override, a ``compute_loss_func``), is the same for one batch of ``sample`` given
    ``num_items_in_batch`` of 1 and of 2 (it ignores it). One call each, without gradients, in
    ``eval()`` (dropout would tell two equal losses apart); every module's mode is put back. False
    where ``train()`` counts no items (no ``labels``, or a ``Trainer`` that passes none on) or
    ``compute_loss`` takes no ``num_items_in_batch`` (``train()`` passes it, and raises its own error).
    The model alone was asked before: a subclass whose ``compute_loss`` took a plain mean of the
    logits' cross-entropy over a GPT-2 (which honours the count) stepped 2x the gradient at 8 x 2."""
    collate = training_collator(trainer)
    if num_items_in_batch(trainer, [to_device(collate([sample]), trainer.args.device)]) is None \
            or not _takes_keyword(trainer.compute_loss, "num_items_in_batch"):
        return False
    model, losses = trainer.model, []
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            for items in (1, 2):  # a batch each: compute_loss may pop its labels
                batch = to_device(collate([sample]), trainer.args.device)
                count = torch.tensor(items, device=trainer.args.device)
                loss = trainer.compute_loss(model, batch, num_items_in_batch=count)
                loss = loss[0] if isinstance(loss, tuple) else loss
                if not isinstance(loss, torch.Tensor):
                    return False
                losses.append(loss.detach().float())
    finally:
        for module, training in modes:
            module.training = training
    return bool(torch.allclose(losses[0], losses[1]))


def _takes_keyword(function: Any, name: str) -> bool:
    """Whether ``function`` takes ``name`` as a keyword (or ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _loss_owner(trainer: Any) -> str:
    """What computes the loss ``train()`` trains, as the warning names it."""
    own = type(trainer).compute_loss
    if getattr(own, "__module__", "").split(".")[0] != "transformers":
        return f"{type(trainer).__name__}.compute_loss (your override)"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "the Trainer's compute_loss_func"
    return f"{type(trainer.model).__name__} (it takes **kwargs)"


def _scaled_for_accumulation(trainer: Any) -> bool:
    """Whether ``training_step`` takes the loss as normalised over the window and does not divide it
    by the accumulation (transformers 5's rule, where ``train()`` counts the items)."""
    explicit = getattr(trainer, "loss_is_scaled_for_ga", None)
    if explicit is not None:
        return bool(explicit)
    return (bool(getattr(trainer, "model_accepts_loss_kwargs", False))
            or getattr(trainer, "compute_loss_func", None) is not None)


def warn_unscaled_accumulation(trainer: Any, sample: Any) -> None:
    """One warning where ``trainer.args.gradient_accumulation_steps`` is above 1, the ``Trainer``
    takes the loss as normalised by ``num_items_in_batch`` and so divides it by nothing
    (``model_accepts_loss_kwargs``, a ``compute_loss_func``, or ``loss_is_scaled_for_ga=True``), and the
    loss it trains ignores the count (:func:`ignores_num_items`: the model's, a subclass's
    ``compute_loss``, the function's): each optimizer step's gradient is the accumulation times the
    mean (module description). The message names the fix: for the model's own loss
    ``trainer.model_accepts_loss_kwargs = False``, for yours ``trainer.loss_is_scaled_for_ga = False``
    (a per-batch mean, as Transformers' ``compute_loss`` says); the ``Trainer`` then divides.

    Not where the loss is normalised: under ``label_smoothing_factor`` the ``Trainer``'s
    ``LabelSmoother`` divides by ``num_items_in_batch`` (a T5 at 8 x 2 moved its weights as at
    16 x 1), nor where ``trainer.loss_is_scaled_for_ga = False`` already makes the ``Trainer`` divide."""
    steps = int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1)
    if steps <= 1 or not _scaled_for_accumulation(trainer) or not ignores_num_items(trainer, sample):
        return
    owner = _loss_owner(trainer)
    model_only = owner.endswith("(it takes **kwargs)") and getattr(trainer, "loss_is_scaled_for_ga", None) is None
    fix = ("trainer.model_accepts_loss_kwargs = False" if model_only
           else "trainer.loss_is_scaled_for_ga = False (or divide the summed loss by num_items_in_batch)")
    log.warning(
        "fit_batch_size: gradient_accumulation_steps=%d, and the loss of %s ignores num_items_in_batch, so the "
        "Trainer (which then takes it as normalised over the optimizer step) does not divide each micro-batch's loss "
        "by the accumulation: every optimizer step's gradient (and the logged loss) is %d times the mean, as if the "
        "learning rate were %d times larger; set %s before train() (the Trainer then divides by the accumulation "
        "itself)", steps, owner, steps, steps, fix)
