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
micro-batches therefore silently multiplied the learning rate for such a model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..training.batch_ops import to_device
from .transformers_step import training_collator

__all__ = ["ignores_num_items", "warn_unscaled_accumulation"]

log = logging.getLogger("autobatch")


def ignores_num_items(trainer: Any, sample: Any) -> bool:
    """Whether ``trainer``'s model returns the same loss for one batch of ``sample`` given
    ``num_items_in_batch`` of 1 and of 2 (it ignores it). One forward each, without gradients, in
    ``eval()`` (dropout would tell two equal losses apart); every module's mode is put back. False
    where the batch has no ``labels`` or the output no ``loss`` (the ``Trainer`` then normalises
    nothing this way)."""
    batch = to_device(training_collator(trainer)([sample]), trainer.args.device)
    if not isinstance(batch, Mapping) or "labels" not in batch:
        return False
    model, losses = trainer.model, []
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), trainer.accelerator.autocast():
            for items in (1, 2):
                output = model(**batch, num_items_in_batch=torch.tensor(items, device=trainer.args.device))
                loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
                if not isinstance(loss, torch.Tensor):
                    return False
                losses.append(loss.detach().float())
    finally:
        for module, training in modes:
            module.training = training
    return bool(torch.allclose(losses[0], losses[1]))


def warn_unscaled_accumulation(trainer: Any, sample: Any) -> None:
    """One warning where ``trainer.args.gradient_accumulation_steps`` is above 1, the ``Trainer``
    leaves the loss to the model (``model_accepts_loss_kwargs``, no ``compute_loss_func``) and the
    model ignores ``num_items_in_batch`` (:func:`ignores_num_items`): each optimizer step's gradient
    is the accumulation times the mean (module description). The message names the fix:
    ``trainer.model_accepts_loss_kwargs = False``, after which the ``Trainer`` divides by the
    accumulation itself.

    Not where the model's loss is not the one trained: under ``label_smoothing_factor`` the
    ``Trainer``'s ``LabelSmoother`` computes it from the logits and divides by ``num_items_in_batch``
    (a T5 at 8 x 2 moved its weights as at 16 x 1), so the warning was false there and its advice
    idle; nor where ``trainer.loss_is_scaled_for_ga = False`` already makes the ``Trainer`` divide."""
    steps = int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1)
    if (steps <= 1 or not getattr(trainer, "model_accepts_loss_kwargs", False)
            or getattr(trainer, "compute_loss_func", None) is not None
            or getattr(trainer, "label_smoother", None) is not None
            or getattr(trainer, "loss_is_scaled_for_ga", None) is False or not ignores_num_items(trainer, sample)):
        return
    log.warning(
        "fit_batch_size: gradient_accumulation_steps=%d, and %s takes **kwargs but ignores num_items_in_batch, so the "
        "Trainer (model_accepts_loss_kwargs=True) does not divide each micro-batch's loss by the accumulation: every "
        "optimizer step's gradient (and the logged loss) is %d times the mean, as if the learning rate were %d times "
        "larger; set trainer.model_accepts_loss_kwargs = False before train() (the Trainer then divides by the "
        "accumulation itself)", steps, type(trainer.model).__name__, steps, steps)
