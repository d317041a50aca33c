"""Learning-rate schedules sized for the batch size :class:`~autobatch.integrations.lightning.AutoBatchSize` sets.

Why: Lightning calls the module's ``configure_optimizers`` in ``trainer.strategy.setup``, before
the ``on_fit_start`` hook in which the callback sets the batch size (and, with ``global_batch``,
``accumulate_grad_batches``). A schedule sized from the step count, such as
``OneCycleLR(total_steps=self.trainer.estimated_stepping_batches)`` or a warmup and cosine
``LambdaLR``, was so sized for the module's own batch size: at a larger size fit runs fewer
steps and the learning rate never anneals (silently worse training); at a smaller one the
scheduler is stepped past its total and ``OneCycleLR`` raised ``ValueError: Tried to step N
times`` at the end of training (Lightning's ``BatchSizeFinder`` has the same bug).

What: :class:`StepSchedule` counts ``trainer.estimated_stepping_batches`` at fit start, before the
trials change anything (the count ``configure_optimizers`` saw). Once the size is set (probed, or
restored from the callback's checkpoint state), where a scheduler is stepped by optimizer step
(``interval="step"``; any, under manual optimization) and the count at the new size differs,
``configure_optimizers`` runs again through Lightning's own path (``strategy.setup_optimizers``,
the precision plugin's ``connect``, the optimizers moved to the device, as ``strategy.setup``
does), so the user's code sizes its schedulers at the size fit trains at, with its own learning
rates and hyperparameters; logged once. The optimizers then hold no state that matters: the
trials' states were put back (fresh optimizers), and a resumed fit's optimizer and scheduler
states are loaded by Lightning after ``on_fit_start`` (``restore_training_state``), into the new
ones. Where that is not so, nothing runs again and one warning names the schedulers, both counts
and what to change: a strategy that sets its optimizers up its own way (DeepSpeed's engine, any
``setup`` or ``setup_optimizers`` other than Lightning's single-device, DDP, FSDP,
model-parallel and XLA ones, which create plain torch optimizers in ``setup_optimizers``), a
precision plugin whose ``connect`` wraps them, or optimizers that hold state already (FSDP
resumed: it loads the optimizer states with the checkpoint, before the callback's state).

The same holds for a hyperparameter ``configure_optimizers`` derives from the batch size (a
learning rate scaled with it): where the optimizers it makes at the size set differ in one from
the trainer's, it runs again the same way (``StepSchedule._rescaled``).

Counting builds the train dataloader as ``fit`` builds it (under ``limit_train_batches``), then
drops it, the random states put back (a loader's iterator draws its seed); a loader already
built (``configure_optimizers`` asked for the count) is read as it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr

from ..training.checkpoints.checkpoint_io import rng_state, set_rng_state
from .lightning_loop import training_batches
from .lightning_tuners import tell

__all__ = ["StepSchedule", "step_schedulers", "stepping_batches", "train_loader", "unsafe"]


@dataclass
class StepSchedule:
    """The optimizer steps the schedulers were sized for, and at which size.

    ``steps``: ``trainer.estimated_stepping_batches`` when they were configured (None: no
    scheduler is stepped by optimizer step); ``name``: the batch size attribute; ``batch_size``
    and ``accumulation``: its value and ``accumulate_grad_batches`` then; ``logged``,
    ``warned``: said so already in this fit."""

    steps: int | float | None
    name: str
    batch_size: Any
    accumulation: int
    logged: bool = False
    warned: bool = False

    @classmethod
    def taken(cls, trainer: Trainer, module: LightningModule, name: str) -> "StepSchedule":
        """The count ``configure_optimizers`` saw: call before anything changes the size."""
        steps = stepping_batches(trainer) if step_schedulers(trainer) else None
        return cls(steps, name, lightning_getattr(module, name), trainer.accumulate_grad_batches)

    def resize(self, trainer: Trainer, batch_size: int) -> bool:
        """Run ``configure_optimizers`` again where fit will run another number of optimizer steps
        at ``batch_size`` (and the trainer's accumulation) than the schedulers were sized for,
        and it is safe (else warn once); whether it ran."""
        if self.steps is None or not step_schedulers(trainer):
            return self._rescaled(trainer, batch_size)
        with _train_loader(trainer):  # built once: configure_optimizers' own count reads it
            steps = trainer.estimated_stepping_batches
            if steps == self.steps:
                return self._rescaled(trainer, batch_size)
            why = unsafe(trainer)
            if why is None:
                _configure(trainer)
        names, accumulation = ", ".join(step_schedulers(trainer)), trainer.accumulate_grad_batches
        configured = (f"{self.steps} optimizer steps at {self.name}={self.batch_size} "
                      f"(accumulate_grad_batches={self.accumulation})")
        will_run = f"{steps} at {self.name}={batch_size} (accumulate_grad_batches={accumulation})"
        if why is not None:
            if not self.warned:
                rank_zero_warn(
                    f"AutoBatchSize: the learning-rate scheduler(s) {names}, stepped by optimizer step, were sized in "
                    f"configure_optimizers for {configured}, before the callback set the size; fit will run "
                    f"{will_run}: the schedule will not end where training ends (OneCycleLR raises once stepped past "
                    f"its total). configure_optimizers is not run again: {why}. Set {self.name}={batch_size} (and "
                    f"accumulate_grad_batches={accumulation}) where configure_optimizers reads them, or size the "
                    "schedule from a step count that does not depend on the batch size (Trainer(max_steps=N, "
                    "max_epochs=-1))")
                self.warned = True
            return False
        if not self.logged:
            tell("AutoBatchSize: ran configure_optimizers again at the size set: its scheduler(s) %s, stepped by "
                 "optimizer step, were sized for %s, as Lightning configures optimizers before on_fit_start; fit "
                 "will run %s", names, configured, will_run)
            self.logged = True
        self.steps, self.batch_size, self.accumulation = steps, batch_size, accumulation
        return True

    def _rescaled(self, trainer: Trainer, batch_size: int) -> bool:
        """Run ``configure_optimizers`` again where the optimizers it makes at ``batch_size`` differ
        in a hyperparameter from those made at the module's own size (a learning rate scaled with the
        batch, ``lr=base_lr * self.hparams.batch_size / 256``), and it is safe (else warn once);
        whether it ran. Why: Lightning configures the optimizers before ``on_fit_start``, so fit
        trained at batch 506 with the learning rate of batch 2 (0.00078 where the module's rule gives
        0.198), silently (Lightning's ``BatchSizeFinder`` too)."""
        if batch_size == self.batch_size or self.warned:
            return False
        with _train_loader(trainer):  # where configure_optimizers counts its steps
            changed = _changed_hyperparameters(trainer)
        if not changed:
            return False
        why, was = unsafe(trainer), f"{self.name}={self.batch_size}"
        if why is not None:
            rank_zero_warn(
                f"AutoBatchSize: configure_optimizers gives other {', '.join(changed)} at {self.name}={batch_size} than "
                f"at {was}, where Lightning configured the optimizers before the callback set the size; it is not run "
                f"again: {why}. Set {self.name}={batch_size} where configure_optimizers reads it")
            self.warned = True
            return False
        _configure(trainer)
        tell("AutoBatchSize: ran configure_optimizers again at the size set: it gives other %s at %s=%s than at %s, "
             "as Lightning configures optimizers before on_fit_start", ", ".join(changed), self.name, batch_size, was)
        self.batch_size = batch_size
        return True


def _changed_hyperparameters(trainer: Trainer) -> list[str]:
    """The param-group hyperparameters (``lr``, ``weight_decay``, ...) whose values differ between
    the trainer's optimizers and those the module's ``configure_optimizers`` makes now (dropped
    again, the random states put back)."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    saved = rng_state()
    try:
        optimizers, _ = _init_optimizers_and_lr_schedulers(trainer.lightning_module)
    finally:
        set_rng_state(saved)
    changed: set[str] = set()
    for new, old in zip(optimizers, trainer.optimizers):
        for fresh, held in zip(new.param_groups, old.param_groups):
            changed.update(key for key, value in fresh.items() if key != "params" and not _same(value, held.get(key)))
    return sorted(changed)


def _same(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values are equal (tensors by value)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # a tensor of several values, or not comparable
        return repr(a) == repr(b)


def step_schedulers(trainer: Trainer) -> list[str]:
    """The class names of the trainer's schedulers that are stepped by optimizer step: those
    with ``interval="step"``; every one under manual optimization (the ``training_step`` steps
    them, where it likes). An epoch-interval scheduler is stepped once an epoch, and the epochs
    do not change with the batch size."""
    module = trainer.lightning_module
    manual = module is not None and not module.automatic_optimization
    return [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs
            if manual or config.interval == "step"]


def unsafe(trainer: Trainer) -> str | None:
    """Why ``configure_optimizers`` must not run again now (None: it may).

    Safe where the strategy's ``setup`` and ``setup_optimizers`` are Lightning's own for a single
    device, DDP (its spawn, fork and notebook variants), FSDP, model parallelism or XLA: each
    creates plain torch optimizers in ``setup_optimizers``, passes them to the precision plugin's
    ``connect`` and moves them to the device, nothing else (FSDP's ``setup_optimizers`` first
    drops the old ones itself). DeepSpeed (a subclass of DDP's) builds its engine around them in
    ``setup`` instead."""
    from lightning.pytorch.strategies import (DDPStrategy, FSDPStrategy, ModelParallelStrategy,
                                              SingleDeviceXLAStrategy, Strategy, XLAStrategy)

    strategy = trainer.strategy
    kind = type(strategy)
    setups = {own.setup for own in (Strategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy, XLAStrategy,
                                    SingleDeviceXLAStrategy)}
    makers = {own.setup_optimizers for own in (Strategy, FSDPStrategy, ModelParallelStrategy)}
    if kind.setup not in setups or kind.setup_optimizers not in makers:
        return (f"the {kind.__name__} strategy sets up its optimizers its own way (an engine may wrap them and "
                "their schedulers)")
    plugin = type(strategy.precision_plugin)
    if plugin.connect is not Precision.connect:
        return f"the precision plugin {plugin.__name__} wraps the optimizers (its connect)"
    loaded = bool(trainer._checkpoint_connector._loaded_checkpoint) and not strategy.lightning_restore_optimizer
    if loaded or any(getattr(optimizer, "state", None) for optimizer in trainer.optimizers):
        return ("the optimizers hold state already (as where the strategy loads it with the checkpoint), which new "
                "ones would lose")
    return None


def stepping_batches(trainer: Trainer) -> int | float:
    """``trainer.estimated_stepping_batches`` at the size and accumulation set now; the train
    dataloader, where it must be built to count, dropped again and the random states put back."""
    with _train_loader(trainer):
        return trainer.estimated_stepping_batches


@contextmanager
def train_loader(trainer: Trainer) -> Iterator[int | float]:
    """The train dataloader built as ``fit`` builds it (at the size set now, under
    ``limit_train_batches``, :func:`~.lightning_loop.training_batches`) while inside, its batches per
    epoch yielded; dropped on the way out, its workers shut down, and the random states put back (a
    loader's iterator draws its seed; fit builds its own). A loader already built is read as it
    is, and kept."""
    loop = trainer.fit_loop
    if loop._combined_loader is not None:
        yield loop.max_batches
        return
    saved = rng_state()
    try:
        yield training_batches(trainer)  # an integer val_check_interval longer than the epoch is the callback's to report
    finally:
        set_rng_state(saved)
        if loop._data_fetcher is not None:
            loop._data_fetcher.teardown()
        loop._combined_loader = loop._data_fetcher = None


@contextmanager
def _train_loader(trainer: Trainer) -> Iterator[None]:
    """:func:`train_loader` where ``estimated_stepping_batches`` needs one: not under
    ``max_epochs=-1`` (``max_steps`` alone counts the steps)."""
    if trainer.max_epochs == -1:
        yield
        return
    with train_loader(trainer):
        yield


def _configure(trainer: Trainer) -> None:
    """``configure_optimizers`` again, as ``strategy.setup`` runs it while fitting: new optimizers
    and scheduler configs on the strategy (``trainer.optimizers``, ``trainer.lr_scheduler_configs``
    and the module's ``optimizers()`` read them there), connected to the precision plugin, on the
    device."""
    strategy = trainer.strategy
    strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    _optimizers_to_device(strategy.optimizers, strategy.root_device)
