"""A ``loss_fn`` that zeroes the gradients: refused where it would discard a micro-batch's.

The runner accumulates the global batch's gradient over its micro-batches and zeroes it itself,
before and after each optimizer step. A ``loss_fn`` ported from a hand-written loop sometimes
keeps that loop's ``optimizer.zero_grad()`` (or ``model.zero_grad()``, ``set_to_none`` either
way): in one micro-batch it is harmless, as the gradients are empty there anyway, so a run at
``micro_batch == global_batch`` trains as it should; but the first step trained in two pieces
(an OOM replay at a smaller micro-batch, a plan with accumulation) kept only the last piece's
gradient, and the run went on with other weights than one without the OOM, without a word
(SGD, a batch of 8 replayed as 4 + 4: 0.02 off). So between a micro-batch's forward and its
backward (the span ``loss_fn`` runs in) the runner watches one parameter's gradient left by the
earlier micro-batches: dropped (``set_to_none=True``), or written in place and now all zeros
(``set_to_none=False``), it raises one error naming the cause, the step undone as after any
error. A ``scheduler.step()`` kept in ``loss_fn`` is the same case (stepped once per micro-batch:
once per step until a replay, then twice, and ``OneCycleLR`` raises past its ``total_steps``):
a learning rate changed in that span after the step's first micro-batch is one error too, naming
``Runner(scheduler=...)`` and ``on_step_end``. One parameter, one id and version read per micro-batch: no device sync, except one
``any()`` where the gradient was written in place (a DDP bucket rebuild replaces it, keeping its values).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AccumulationBrokenError  # defined with autobatch's other errors; importable from here too
from .loss_writes import WatchesLossWrites

__all__ = ["WatchesGrads", "AccumulationBrokenError"]


class WatchesGrads(WatchesLossWrites):
    """A mixin of the runner's recovery (:class:`~autobatch.training.oom.recovery.OomRecovery`), whose
    phase hook calls :meth:`_watch_grads` at every phase boundary (``self.optimizer`` is the runner's)."""

    _grad_seen: tuple[torch.Tensor, int, int] | None = None  # (param, its grad's id and version) at forward: no
    # reference to the gradient, which a replay after an OOM must find freed
    _lr_seen: tuple[Any, ...] | None = None  # the groups' learning rates at that forward

    def _watch_grads(self, phase: str) -> None:
        """At ``"forward"`` note the first gradient the earlier micro-batches left; at ``"backward"``
        raise :class:`AccumulationBrokenError` where ``loss_fn`` dropped or zeroed it; warn once where it wrote
        a tensor outside the model (:mod:`~autobatch.training.loss_writes`)."""
        self._watch_loss_writes(phase)
        if phase == "forward":
            self._grad_seen = _first_grad(self.optimizer)
            self._lr_seen = _lr_marks(self.optimizer) if self._grad_seen is not None else None
            return
        seen, self._grad_seen = self._grad_seen, None
        if phase != "backward" or seen is None:
            return
        if _lr_marks(self.optimizer) != self._lr_seen:
            raise AccumulationBrokenError(
                "loss_fn changed the learning rate between this micro-batch's forward and its backward, as a "
                "scheduler.step() inside loss_fn does: it runs once per micro-batch, so once per optimizer step at one "
                "micro-batch and more often after an OOM replays the step in smaller ones (OneCycleLR then raises for "
                "too many steps). Pass the scheduler as Runner(scheduler=...) (stepped once per optimizer step, undone "
                "with a failed step), or step it in on_step_end; loss_fn returns the loss only")
        param, ident, version = seen
        grad = param.grad
        if grad is not None and (id(grad), grad._version) == (ident, version):
            return
        if grad is not None and bool(grad.any()):  # replaced or written, values kept (a DDP bucket rebuild)
            return
        how = "dropped (set_to_none=True)" if grad is None else "set to zero (set_to_none=False)"
        raise AccumulationBrokenError(
            "loss_fn zeroed the gradients: between this micro-batch's forward and its backward, the gradient the step's "
            f"earlier micro-batches left was {how}, as optimizer.zero_grad() or model.zero_grad() inside loss_fn does. "
            "The runner sums each global batch's gradient over its micro-batches (a smaller one after an OOM) and zeroes "
            "it itself around every optimizer step, so such a loss_fn trains on the last micro-batch's gradient alone; "
            "remove the zero_grad() (and any optimizer.step() or scheduler.step()) from loss_fn: it returns the loss only")


def _lr_marks(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """The groups' learning rates, comparable without a device sync: a tensor's by its id and version."""
    return tuple((id(lr), lr._version) if isinstance(lr, torch.Tensor) else lr
                 for lr in (group.get("lr") for group in optimizer.param_groups))


def _first_grad(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, int, int] | None:
    """The first parameter ``optimizer`` trains that has a gradient, with its gradient's id and version (None: none has one)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is not None:
                return param, id(grad), grad._version
    return None
