"""Train mode around ``on_step_end``: an evaluation in the hook that forgets ``model.train()``.

An ``on_step_end`` hook is where a loop's evaluation every N steps goes: ``model.eval()``, a
``torch.no_grad()`` pass over validation data, the metric logged. A hook that forgets
``model.train()`` after it left the whole model in eval mode, and every later step trained so:
dropout off, BatchNorm normalising with (and no longer updating) its running statistics, without
a word; the loss still fell, so nothing showed it. A hand-written loop has the same trap, but
there the ``model.train()`` is in the user's own loop; here the training loop is the runner's, and
the next step is its own. So where the hook turned the model itself from train to eval mode
(``model.eval()``, on the model given to the runner or the module inside its DDP or
``torch.compile`` wrapper), the runner puts every module's mode back as it was before the hook
and warns once, as Lightning puts the train mode back after its validation loop. A hook that
switches submodules only (freezing BatchNorm layers after a warm-up) is left alone, and so is a
model put in eval mode before ``fit()`` (training in eval mode on purpose). A hook that raises in the
middle of its evaluation (an OOM of a validation batch larger than the training micro-batch) gets the
modes put back too, without a warning: before, the model stayed in eval mode, and a later ``fit()`` of
the runner, once the cause was fixed, trained every step so without a word. Cost: one pass over
the model's modules per step, only with a hook (0.5 ms for 1,000 modules on a busy CPU core).
"""

from __future__ import annotations

import logging

import torch

from .checkpoints.resume_checks import saved_module

__all__ = ["HookModes"]

log = logging.getLogger("autobatch")


class HookModes:
    """The modes of ``model``'s modules before a hook (:meth:`before`), put back after it
    (:meth:`after`) where the hook put the model itself in eval mode."""

    def __init__(self) -> None:
        self._warned = False
        self._saved: list[tuple[torch.nn.Module, bool]] | None = None
        self._roots: tuple[torch.nn.Module, ...] = ()

    def before(self, model: torch.nn.Module) -> None:
        """Note the modes, where the model trains (nothing to put back otherwise): one pass over its modules."""
        bare = saved_module(model)
        self._roots = tuple(root for root in {id(model): model, id(bare): bare}.values() if root.training)
        self._saved = [(module, module.training) for module in model.modules()] if self._roots else None

    def after(self, step: int, warn: bool = True) -> None:
        """Put the modes back where the hook turned the model from train to eval mode, and warn once
        (``warn=False``: a hook that raised, in the middle of its evaluation, whose ``model.train()`` never ran)."""
        saved, self._saved = self._saved, None
        if saved is None or all(root.training for root in self._roots):
            return
        for module, training in saved:
            module.training = training  # as Module.train(mode) sets it, module by module
        self._roots = ()
        if warn and not self._warned:
            self._warned = True
            log.warning(
                "on_step_end after step %d left the model in eval mode (model.eval() for an evaluation, without "
                "model.train() after it): the runner put back the modes the model had before the hook, so the next "
                "steps train as the earlier ones did (dropout on, BatchNorm updating its statistics). Call "
                "model.train() at the end of the evaluation to silence this; to train on in eval mode on purpose, "
                "switch the layers themselves (the model's children), not the model", step)
