"""``AutoBatchSize`` beside Lightning's tuner callbacks, and its lines where Lightning's go.

Lightning moves its tuner callbacks (``BatchSizeFinder``, ``LearningRateFinder``) to the front
of ``trainer.callbacks``, so their ``on_fit_start`` runs before any other callback's:

* a ``BatchSizeFinder`` beside ``AutoBatchSize`` is refused (:func:`arrange_tuners`): its
  trials would be spent and its answer replaced. One that ``Tuner.scale_batch_size`` added is
  taken out of ``trainer.callbacks`` first: the Tuner removes it only after a fit that returns,
  so it stayed and every later ``fit`` on the trainer failed, naming a callback never added;
* a ``LearningRateFinder`` searched at the module's own batch size, and ``fit`` then trained at
  the callback's with that rate (on the CPU's simulated 3 MiB: the finder's steps at 4 samples,
  ``fit``'s at 544). :func:`arrange_tuners` moves the callback ahead of the first finder, in
  ``setup``, so the rate is found at the size ``fit`` trains at.

:func:`tell` writes the callback's outcome (the size set, restored, the order changed): a
Lightning script configures no ``logging``, and Lightning shows its own INFO lines (its
``BatchSizeFinder``'s "will continue with full run using batch size ...") through the
``lightning.pytorch`` logger's handler, where a line of the ``autobatch`` logger at INFO was
shown nowhere.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["arrange_tuners", "tell"]

log = logging.getLogger("autobatch")


def tell(message: str, *args: Any) -> None:
    """Log one INFO line of the callback's outcome: to the ``autobatch`` logger where that shows
    INFO (logging configured, or a test's ``caplog``), else through Lightning's rank-zero INFO,
    which Lightning shows by default. One of the two, so a configured root logger does not print
    the line twice."""
    if log.isEnabledFor(logging.INFO):
        log.info(message, *args)
    else:
        rank_zero_info(message % args if args else message)


def arrange_tuners(trainer: Trainer, callback: Callback) -> None:
    """In ``setup`` for ``fit``: refuse a ``BatchSizeFinder`` beside ``callback``, and move
    ``callback`` ahead of the first ``LearningRateFinder`` (see the module's docstring)."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    finders = [other for other in trainer.callbacks if isinstance(other, BatchSizeFinder)]
    tuners = [other for other in finders if getattr(other, "_early_exit", False)]  # Tuner.scale_batch_size's own
    if tuners:
        # Lightning's Tuner removes its finder only after a fit that returns: left in, it failed every later
        # fit on this trainer with this error, telling to remove a callback the user never added
        trainer.callbacks = [other for other in trainer.callbacks if all(other is not tuner for tuner in tuners)]
        raise ValueError("AutoBatchSize and Tuner.scale_batch_size both set the batch size: remove the "
                         "Tuner(trainer).scale_batch_size(...) call and call trainer.fit, where AutoBatchSize "
                         "sets the size (this trainer is left with the callbacks you gave it)")
    if finders:
        raise ValueError("AutoBatchSize and Lightning's BatchSizeFinder both set the batch size: remove the "
                         "BatchSizeFinder callback from Trainer(callbacks=...), or from --trainer.callbacks under LightningCLI "
                         "(AutoBatchSize replaces it)")
    callbacks = list(trainer.callbacks)
    first = next((i for i, other in enumerate(callbacks) if isinstance(other, LearningRateFinder)), None)
    mine = next((i for i, other in enumerate(callbacks) if other is callback), None)
    if first is not None and mine is not None and first < mine:
        callbacks.insert(first, callbacks.pop(mine))
        trainer.callbacks = callbacks  # on_fit_start runs in this order; setup's loop goes on over the old list
        tell("AutoBatchSize: runs before LearningRateFinder, so the learning rate is found at the batch size fit "
             "trains at")
