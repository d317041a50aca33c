"""What a confirmation run of Lightning's fit loop changes on the trainer, set for the run and put back after it.

:mod:`.lightning_loop` runs a few optimizer steps of the trainer's real ``fit_loop`` at a size
(:func:`~.lightning_loop.confirm_in_loop`); this module holds what that run sets aside and restores,
as Lightning's ``BatchSizeFinder`` dumps and restores it (:class:`_LoopState`: loop progress, limits,
callbacks, loggers, logged metrics, the schedulers' ``step``, the trainer's stage), the train
dataloader built as ``fit`` builds it (:func:`training_batches`, :func:`refuses_interval`), and the
lines the run would print as if ``fit`` had ended (:func:`quiet_stop`). Split from
:mod:`.lightning_loop` (the search over sizes and the memory it measures) to keep each module to
one concept.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Iterator

from lightning.pytorch import Trainer

__all__ = ["quiet_stop", "refuses_interval", "training_batches"]


def training_batches(trainer: Trainer) -> int | float:
    """Build the train dataloader as ``fit`` builds it (``fit_loop.setup_data``, at the size set,
    under ``limit_train_batches``) and return its batches per epoch (inf: no length); the loader
    stays built (a loop run uses it; the caller drops it otherwise).

    Without Lightning's check of an integer ``val_check_interval`` against those batches
    (:func:`refuses_interval`), which raised from inside the callback's loop run where a larger
    batch made the epoch shorter than the interval: such a run validates at each epoch's end
    instead (as ``val_check_interval=1.0`` does), and the callback says once, before ``fit``
    trains, what to change if the size it sets is one (``lightning_epochs.check_val_interval``).
    Every other interval is kept as Lightning sets it."""
    loop, every = trainer.fit_loop, trainer.check_val_every_n_epoch
    trainer.check_val_every_n_epoch = None  # turns the check off: setup_data reads it nowhere else
    try:
        loop.setup_data()
    finally:
        trainer.check_val_every_n_epoch = every
    if refuses_interval(trainer, loop.max_batches):
        trainer.val_check_batch = max(1, int(loop.max_batches))
    return loop.max_batches


def refuses_interval(trainer: Trainer, batches: int | float) -> bool:
    """Whether Lightning's ``fit_loop.setup_data`` refuses the trainer's ``val_check_interval`` for
    an epoch of ``batches``: an integer interval (counted in batches within an epoch) above them,
    while ``check_val_every_n_epoch`` is set and ``limit_val_batches`` above 0."""
    interval = getattr(trainer, "val_check_interval", None)
    return (isinstance(interval, int) and getattr(trainer, "_val_check_time_interval", None) is None
            and trainer.check_val_every_n_epoch is not None and trainer.limit_val_batches > 0 and 0 < batches < interval)


def _held_step(*_: Any, **__: Any) -> None:
    """A scheduler's ``step`` during a check run: nothing (:meth:`_LoopState.prepare`)."""


def _set_restarting(loop: Any, restarting: bool) -> None:
    """Set the fit loop's and its child loops' restarting flag after ``load_state_dict`` (which
    turns it on). The fit loop's own setter keeps it on for iteration-based training
    (``max_steps``), which made ``fit`` skip its sanity check after the callback ran; the base
    loop's setter sets what it is given."""
    try:
        from lightning.pytorch.loops.loop import _Loop
    except ImportError:  # another layout of Lightning's internals: its own setter, as before
        loop.restarting = restarting
        return
    _Loop.restarting.fset(loop, restarting)


@dataclass
class _LoopState:
    """What a loop run changes on the trainer, as ``BatchSizeFinder`` dumps and restores it."""

    loop_state: dict[str, Any]
    callbacks: list[Any]
    loggers: list[Any]
    max_steps: int
    limit_train_batches: Any
    limit_val_batches: Any
    restarting: bool  # as fit found it: on where it resumes from a checkpoint (ckpt_path=...)
    validate: bool  # fit validates (a validation_step, a val dataloader, limit_val_batches above 0)
    val_reload_epoch: Any  # the validation loop's record of when it last built its dataloader
    stage: Any  # the trainer's running stage (TRAINING): a run that fails while validating leaves VALIDATING
    held: list[Any] = field(default_factory=list)  # the schedulers whose step the run holds

    @classmethod
    def take(cls, trainer: Trainer) -> "_LoopState":
        loop = trainer.fit_loop
        return cls(deepcopy(loop.state_dict()), trainer.callbacks, trainer.loggers,
                   loop.epoch_loop.max_steps, trainer.limit_train_batches, trainer.limit_val_batches,
                   bool(getattr(loop, "_restarting", False)), bool(trainer.enable_validation),
                   getattr(loop.epoch_loop.val_loop, "_last_val_dl_reload_epoch", None), trainer.state.stage)

    def prepare(self, trainer: Trainer, steps: int, watch: Any) -> None:
        from lightning.pytorch import Callback
        from lightning.pytorch.loggers.logger import DummyLogger

        # no checkpoint, progress bar or user callback runs during the check; only the watch
        trainer.callbacks = [type("_Watch", (Callback,), {"on_train_batch_end": watch.on_train_batch_end,
                                                         "on_validation_batch_end": watch.on_validation_batch_end})()]
        trainer.logger = DummyLogger() if trainer.logger is not None else None
        # no schedule steps either (Lightning's, or the training_step's under manual optimization):
        # memory does not follow the learning rate, the states are put back after the run anyway,
        # and a schedule sized for fewer steps than the run (OneCycleLR at a module size whose
        # epochs take two steps) raised from inside it
        self.held = [config.scheduler for config in trainer.lr_scheduler_configs]
        for scheduler in self.held:
            scheduler.step = _held_step
        # one validation batch after the last step, where fit validates: its batch may follow the
        # batch size (a val loader at twice the size, no gradients), the optimizer's state is alive
        trainer.limit_train_batches, trainer.limit_val_batches = 1.0, 1 if self.validate else 0
        loop = trainer.fit_loop
        epoch_loop = loop.epoch_loop
        # counted from the steps already taken: a second fit on the same trainer starts at its first
        # fit's global_step, and a run capped at `steps` there took none (the size went unconfirmed)
        epoch_loop.max_steps = trainer.global_step + steps
        own = epoch_loop._should_check_val_fx  # where fit validates (an epoch's end the run crosses), and
        epoch_loop._should_check_val_fx = lambda *args: self.validate and (  # after the run's last step
            (trainer.global_step >= epoch_loop.max_steps and not epoch_loop._should_accumulate()) or own(*args))
        loop.load_state_dict(deepcopy(self.loop_state))
        _set_restarting(loop, False)  # a check run is no resumed run
        loop._combined_loader = epoch_loop.val_loop._combined_loader = None  # built at the size just set
        training_batches(trainer)  # built here: an integer val_check_interval longer than its epoch is no error

    def epoch_batches(self, batches: float | int | None, accumulation: int, done: int) -> int | None:
        """The batches of an epoch that ``fit`` will run, from a full epoch's at this size, under ``limit_train_batches``
        and the steps ``max_steps`` leaves after ``done`` (a second fit's start) (None: unknown, an endless loader)."""
        if batches is None or batches == float("inf"):
            return None
        limit = self.limit_train_batches
        batches = int(batches if limit is None else min(batches, limit) if isinstance(limit, int) else batches * limit)
        return batches if self.max_steps is None or self.max_steps < 0 else min(batches, (self.max_steps - done) * accumulation)

    def restore(self, trainer: Trainer) -> None:
        trainer.callbacks, trainer.loggers = self.callbacks, self.loggers
        for scheduler in self.held:
            vars(scheduler).pop("step", None)  # the class's own again
        trainer.limit_train_batches, trainer.limit_val_batches = self.limit_train_batches, self.limit_val_batches
        loop = trainer.fit_loop
        loop.epoch_loop.max_steps = self.max_steps
        vars(loop.epoch_loop).pop("_should_check_val_fx", None)  # the class's own again
        if self.val_reload_epoch is not None:
            loop.epoch_loop.val_loop._last_val_dl_reload_epoch = self.val_reload_epoch
        loop.load_state_dict(deepcopy(self.loop_state))
        _set_restarting(loop, self.restarting)
        loop._combined_loader = None
        loop.epoch_loop.val_loop._combined_loader = None
        trainer._logger_connector.reset_results()
        trainer._logger_connector.reset_metrics()
        trainer.should_stop = False
        # a run that ran out of memory in its validation batch left the trainer validating: fit's
        # _run_stage then ran only the validation loop, and fit returned having trained nothing
        # (the module's eval mode goes back with its attributes, in the caller's reset)
        trainer.state.stage = self.stage


class _FitStopped(logging.Filter):
    """Drops Lightning's "`Trainer.fit` stopped: ..." INFO line (see :func:`quiet_stop`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("`Trainer.fit` stopped:")


@contextmanager
def quiet_stop() -> Iterator[None]:
    """Mute Lightning's "`Trainer.fit` stopped: `max_steps=3` reached." while a check run ends.

    Why: every confirmation run ends at its own ``max_steps`` (the trainer's ``global_step`` plus
    ``confirm_steps``), and Lightning's fit loop said so on the console before ``fit`` trained, as if
    the user's ``fit`` had stopped at a ``max_steps`` they never set (``max_epochs=1`` printed
    "`Trainer.fit` stopped: `max_steps=3` reached.", then trained the epoch). Only that line, only
    during the run; Lightning's rank-zero logger is the one its ``rank_zero_info`` writes to."""
    try:
        import lightning_utilities.core.rank_zero as rank_zero
        logger = rank_zero.log
    except (ImportError, AttributeError):  # another layout of Lightning's internals: the line stays
        yield
        return
    muted = _FitStopped()
    logger.addFilter(muted)
    try:
        yield
    finally:
        logger.removeFilter(muted)
