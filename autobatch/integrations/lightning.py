"""``AutoBatchSize``: a Lightning callback that sets the batch size from autobatch's probe.

At fit start it probes the module's real training step, the one ``fit`` will run: the module's ``training_step``
(through the strategy, under the precision plugin), ``backward`` and the optimizer step from
``configure_optimizers`` (with the precision plugin's gradient scaler and clipping), on batches of any size
built from the first batch of the train dataloader, passed through the loop's own input path (``convert_input``,
the batch-transfer hooks; see :mod:`.lightning_step`). No user callback's hook runs during the trials. The
search is :func:`~autobatch.find_max_batch` (the exact boundary in a handful of trials, where Lightning's
``BatchSizeFinder`` doubles and may stop at a power of two). The size goes where ``BatchSizeFinder`` puts it
(``model.batch_size``, ``model.hparams.batch_size``, the datamodule's attribute or its ``hparams`` entry, found
with Lightning's ``lightning_hasattr``), and the train dataloader is re-created at it, never larger than the
train dataset (under DDP: a rank's share; a fractional ``limit_train_batches``: one batch of its limited epoch,
:func:`.lightning_epochs.epoch_cap`). The module (its plain attributes too: gathered outputs, counters, metric
states), its optimizers, the scaler, the learning-rate schedulers and the random states are put back bit-exactly
after the trials (:mod:`.lightning_state`); no checkpoint file is written. The size is saved in Lightning's
checkpoints (the callback's state): ``fit(ckpt_path=...)`` trains at it again once one trial there fits with
``margin`` kept and, with ``confirm``, a run of the fit loop passes (else split into micro-batches that do:
:mod:`.lightning_trials`), without a new search; a later ``fit``
with nothing left to train is not probed. Dataloaders passed to ``fit()`` directly are refused, as
``BatchSizeFinder`` refuses them. An integer ``val_check_interval`` longer than an epoch at the size set (which
``fit`` would refuse) is one ``ValueError`` before training, naming what to change.

With ``global_batch`` the callback keeps that many samples per optimizer step: it sets
``trainer.accumulate_grad_batches`` and a batch size no larger than the probed one with
``batch × accumulation × world size == global_batch`` (the batch a multiple of ``multiple_of``);
the Trainer's own ``accumulate_grad_batches`` is kept where it splits the global batch into
batches that fit, else replaced with a warning. Under ``fast_dev_run`` nothing is probed (one
warning, as ``BatchSizeFinder``): the module's own size trains.

Requires ``lightning`` (``pip install -e ".[lightning]"`` from the checkout).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping

import torch

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ModuleNotFoundError as exc:  # only this integration needs it: say what to install
    if exc.name not in ("lightning", "lightning.pytorch"):
        raise
    raise ModuleNotFoundError(
        "autobatch.integrations.lightning needs Lightning 2 (the `lightning` package): pip install "
        "lightning (from the checkout: pip install -e '.[lightning]')", name=exc.name) from exc
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

from ..memory.units import parse_bytes
from ..probe.result import ProbeResult
from ..training.checkpoints.checkpoint_io import rng_state, set_rng_state
from .. import checks
from .global_batch import accumulation_for, cap_at_samples, small_split, split_keeping
from .lightning_epochs import (changed_step, check_limit, check_validation, dropped_note, epoch_cap, fit_ended,
                               scheduled_step)
from .lightning_finder import current_batch_size, finder_options  # noqa: F401 (current_batch_size: its old home)
from .lightning_loaders import check_loader_follows, undo_reloaded_draw
from .lightning_loop import LoopConfirmation, confirm_under_cap
from .lightning_options import checked_batch_arg_name, checked_probe_options
from .lightning_resume import changed_samples, dropped_samples, resumed_split
from .lightning_schedules import StepSchedule
from .lightning_setup import checked_setup
from .lightning_step import first_batch
from .lightning_trials import kept_fits, probe_trials
from .lightning_tuners import arrange_tuners, tell

__all__ = ["AutoBatchSize", "accumulation_for"]


class AutoBatchSize(Callback):
    """Probe the largest batch that trains at fit start, confirm it in Lightning's loop, set it.

    Args:
        batch_arg_name: the attribute holding the batch size (as ``BatchSizeFinder``).
        memory_limit: caps the probe and the confirmation ("16GiB"); passed to
            :func:`~autobatch.find_max_batch`, as are the five below.
        margin: as ``find_max_batch``'s.
        multiple_of: as ``find_max_batch``'s.
        max_batch: as ``find_max_batch``'s.
        strategy: as ``find_max_batch``'s.
        steps_per_trial: as ``find_max_batch``'s.
        global_batch: keep this many samples per optimizer step over all ranks through
            ``accumulate_grad_batches`` (None: leave accumulation alone; one set on the Trainer
            is kept where its micro-batches fit, else replaced with a warning). Refused at fit start
            where the train dataset, or ``trainer.limit_train_batches``, leaves an epoch fewer
            samples than one global batch.
        confirm: after the probe, run ``confirm_steps`` optimizer steps of the trainer's own fit
            loop at the answer, and step down from measurements if the loop runs out of memory
            (:mod:`autobatch.integrations.lightning_loop`). Skipped on more than one rank: an OOM
            on one rank inside the loop's gradient all-reduce would leave the others waiting.
        probe_options: further keyword arguments for ``find_max_batch``. ``mode``, ``init_val``, ``max_trials``,
            ``max_val``: Lightning ``BatchSizeFinder``'s names, mapped to ``strategy``, ``start``, ``max_batch`` as
            :mod:`~autobatch.integrations.lightning_finder` says.

    The probe's options are checked here, as ``find_max_batch`` checks them (``max_batch`` a
    positive integer or None for no cap, ``multiple_of`` a positive integer, ...): a
    ``ValueError`` naming the option now, not an error at fit start.

    After fit start, ``result`` is the :class:`~autobatch.ProbeResult`, ``confirmation`` the
    :class:`~autobatch.integrations.lightning_loop.LoopConfirmation` (its ``summary()`` says why
    the size is safe; also in ``result.notes``), ``batch_size`` the size set and
    ``accumulation`` the ``accumulate_grad_batches`` set (or None). A fit resumed from a checkpoint
    of this callback keeps its samples per step (its size where it fits, checked as
    :func:`~.lightning_trials.kept_fits` says; ``confirmation`` its loop run); ``result`` is None there.
    """

    def __init__(
        self,
        *,
        batch_arg_name: str = "batch_size",
        memory_limit: int | str | None = None,
        margin: float = 0.0,
        multiple_of: int = 1,
        max_batch: int | None = None,
        strategy: str = "auto",
        steps_per_trial: int = 3,
        global_batch: int | None = None,
        confirm: bool = True,
        confirm_steps: int = 3,
        probe_options: Mapping[str, Any] | None = None,
        mode: str | None = None, init_val: int | None = None, max_trials: int | None = None, max_val: int | None = None,
    ) -> None:
        global_batch = checks.positive_int("global_batch", global_batch, allow_none=True)
        checked_batch_arg_name(batch_arg_name)  # else a TypeError, or a field never found, at fit start
        if isinstance(confirm_steps, bool) or not isinstance(confirm_steps, int) or confirm_steps < 1:
            raise ValueError(f"confirm_steps must be a positive integer, got {confirm_steps!r}")
        self.batch_arg_name = batch_arg_name
        self.global_batch = global_batch
        self.confirm, self.confirm_steps = bool(confirm), confirm_steps
        self.memory_limit = None if memory_limit is None else parse_bytes(memory_limit, name="memory_limit")
        self.probe_options = checked_probe_options(*finder_options(dict(
            memory_limit=memory_limit, margin=margin, multiple_of=multiple_of, max_batch=max_batch,
            strategy=strategy, steps_per_trial=steps_per_trial,
        ), probe_options, mode=mode, init_val=init_val, max_trials=max_trials, max_val=max_val))
        self.result: ProbeResult | None = None
        self.confirmation: LoopConfirmation | None = None
        self.batch_size: int | None = None
        self.accumulation: int | None = None
        self._world = self._largest = 1
        self._given: tuple[weakref.ref[Trainer], int] | None = None  # the Trainer's own accumulate_grad_batches (_given_accumulation)
        self._replaced: str | None = None  # why _apply replaced it (warned once the size is final)
        self._fewer: int | None = None  # the accumulation that would fit where the user's was kept
        self._skipped = False  # fast_dev_run: no probe ran, nothing to save in checkpoints
        self._restored: dict[str, Any] | None = None  # the state a checkpoint restored (load_state_dict)
        self._fitting: tuple[Trainer, LightningModule] | None = None  # from on_fit_start to on_train_start
        self._redraw: torch.Tensor | None = None  # the RNG state on_fit_start left, where fit re-creates the loader
        self._own, self._sizes = None, None  # the batch attribute and the loaders' sizes at fit start (check_loader_follows)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(batch_arg_name=self.batch_arg_name)

    def state_dict(self) -> dict[str, Any]:
        """The size (and accumulation) set, saved in Lightning's checkpoints: a run resumed with
        ``fit(ckpt_path=...)`` trains at the size it trained at (see :meth:`load_state_dict`)."""
        if self.batch_size is None or self.batch_size < 1 or self._skipped:
            return {}  # a fast_dev_run's size was not probed: a resumed fit probes
        return {"batch_size": self.batch_size, "accumulation": self.accumulation,
                "global_batch": self.global_batch, "world_size": self._world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the checkpoint's size for the resumed fit. Why not probe again: Lightning still
        holds the loaded checkpoint (weights, optimizer moments) in memory at fit start, so a new
        probe answers a smaller size, and the resumed run would train at another batch and
        another number of steps per epoch than the run it resumes. One trial (and a run of the
        fit loop) checks that it fits this machine (:func:`~.lightning_trials.kept_fits`, from :meth:`_resume`)."""
        self._restored = dict(state_dict)
        if self._fitting is not None and self._restored == self.state_dict():
            self._restored = None  # the size this fit set, back from a tuner's checkpoint (LearningRateFinder's)
        elif self._fitting is not None and not self._resume(*self._fitting):  # restored after on_fit_start, probed
            changed_samples(self._before, self.batch_size, self.accumulation or (self._given or (0, 1))[1], self._world)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fitting = None
        undo_reloaded_draw(self._redraw)
        check_loader_follows(trainer, self._own, self.batch_size, self.batch_arg_name, before=self._sizes)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse a ``BatchSizeFinder`` beside this callback, and run before a ``LearningRateFinder``
        (Lightning runs tuner callbacks first): :func:`~.lightning_tuners.arrange_tuners`."""
        if stage == "fit":
            self._fitting = None  # a fit that stopped before on_train_start (Tuner.lr_find's early exit) left it
            arrange_tuners(trainer, self)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        built = trainer.fit_loop._combined_loader is not None  # its iterator made already: one seed drawn
        self._redraw = None
        self._fit_start(trainer, pl_module)
        if built and trainer.fit_loop._combined_loader is None:  # dropped: fit draws that seed again
            self._redraw = torch.get_rng_state()

    def _fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        world = self._check(trainer, pl_module)
        self._fitting, self.result, self.confirmation = (trainer, pl_module), None, None
        self._replaced, self._fewer, self._skipped, self._sizes = None, None, False, None
        self._before: int | None = None  # a checkpoint's samples per step, resumed without its global_batch
        self._given_accumulation(trainer)
        self._schedule = StepSchedule.taken(trainer, pl_module, self.batch_arg_name)  # before the trials change it
        own = self._own = lightning_getattr(pl_module, self.batch_arg_name)  # before the trials change it
        if self._resume(trainer, pl_module) or fit_ended(trainer, self.batch_arg_name, own):
            return  # the size kept: a resume's (from its checkpoint), or a fit with nothing left to train
        share = None if self.global_batch is None else self.global_batch // world
        if trainer.fast_dev_run:
            self._skip_probe(trainer, pl_module, share)
            return
        options = dict(self.probe_options)
        multiple = options["multiple_of"]
        options["max_batch"], options["start"] = cap_at_samples(
            share, options["max_batch"], options.get("start"), multiple, where=f"global_batch={self.global_batch}")
        saved = rng_state()  # a DataLoader's iterator draws its seed: fit must draw the same
        first, sized, samples, loaders, drops, self._sizes = first_batch(trainer, pl_module, world)
        set_rng_state(saved)
        if samples is not None and share is not None and share > samples:
            raise ValueError(  # an epoch would end first: every optimizer step would train fewer samples
                f"global_batch={self.global_batch} is larger than the train dataset ({samples} samples"
                f"{f' per rank, {world} ranks' if world > 1 else ''}): each epoch would end before one global "
                "batch; lower global_batch"
            )
        # as BatchSizeFinder: no batch larger than the dataset (a rank's share; a fractional limit's batches)
        cap, where = epoch_cap(trainer, samples)
        options["max_batch"], options["start"] = cap_at_samples(
            cap, options["max_batch"], options["start"], multiple, where=where + (f" (a rank of {world})" if world > 1 else ""))
        with probe_trials(trainer, pl_module, first, options, accumulating=share is not None and share > 1,
                          prefetch=not sized, loaders=loaders, own=own, name=self.batch_arg_name) as (self.result, state):
            del first
            self.batch_size, self.accumulation = self._apply(trainer, pl_module, share, self.result.batch_size)
            if self.confirm and world == 1:
                self._confirm(trainer, pl_module, share, state.reset)
            elif self.confirm:
                self.confirmation = LoopConfirmation(self.batch_size, self.result.batch_size, None, skipped=(
                    f"{world} ranks: an OOM on one rank inside the loop's gradient all-reduce would leave the others waiting"))
        set_rng_state(saved)
        if self.batch_size >= 1:  # the reset put the module's attributes back, the batch size among them
            lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
        if world > 1:  # every rank trains the same size (find_max_batch agreed already; this is the guard)
            from ..dist.agreement import agree_min, is_distributed

            if is_distributed():
                agreed = agree_min(self.batch_size, "AutoBatchSize batch size")
                if agreed != self.batch_size:
                    self.batch_size, self.accumulation = self._apply(trainer, pl_module, share, agreed)
        kept = self._given is not None and self._given[1] > 1 and self._given[1] == self.accumulation  # the user's split
        check_limit(trainer, self.global_batch, self.accumulation, self.batch_size, samples, self._fewer if kept else None)
        check_validation(trainer, self.batch_size, self.probe_options["multiple_of"], samples)
        if self.confirmation is not None:
            self.result.notes.append(self.confirmation.summary())
        trainer.fit_loop._combined_loader = None  # the train dataloader is re-created at the new size
        tell("AutoBatchSize: %s=%d (probe %d%s)", self.batch_arg_name, self.batch_size, self.result.batch_size,
             f", accumulate_grad_batches={self.accumulation}" if self.accumulation else "")
        self._warn_replaced()
        self._warn_changed(trainer, own, share, samples, drops)
        if dropped := dropped_note(own, self.batch_size, samples, drops):
            rank_zero_warn(f"AutoBatchSize: {dropped}")
        split = share and not kept and small_split(self.global_batch, world, self._largest, self.batch_size,
                                                   multiple_of=multiple)
        if split:  # a global batch with no divisor near the largest micro-batch: many small ones a step
            rank_zero_warn(f"AutoBatchSize: {split}")
        self._schedule.resize(trainer, self.batch_size)  # schedulers sized for the steps fit will run at it

    def _check(self, trainer: Trainer, module: LightningModule) -> int:
        """One clear error for a setup the callback cannot serve (:func:`.lightning_setup.checked_setup`); the world size."""
        self._world = checked_setup(trainer, module, self.batch_arg_name, self.global_batch, self.probe_options["multiple_of"])
        return self._world

    def _resume(self, trainer: Trainer, module: LightningModule) -> bool:
        """Set the size a checkpoint restored (:meth:`load_state_dict`), where it was found for this
        global batch and world size (split anew under a lower ``max_batch``); whether it did (no search then)."""
        restored, self._restored = self._restored, None
        if not restored:
            return False
        if (restored.get("global_batch"), restored.get("world_size")) != (self.global_batch, self._world):
            self._before = dropped_samples(restored, self.global_batch, self._world)  # warned once the size is set
            return False
        share = (self.global_batch or 0) // self._world
        fits, self.confirmation = (self._largest, self.confirmation) if self.result is not None else kept_fits(
            trainer, module, restored["batch_size"], self.probe_options, world=self._world, name=self.batch_arg_name,
            accumulating=share > 1 or (restored.get("accumulation") or 1) > 1, memory_limit=self.memory_limit,
            confirm_steps=self.confirm_steps if self.confirm and self._world == 1 else 0)  # late restore: the probe's largest
        self.batch_size, self.accumulation = resumed_split(restored, self._given and self._given[1], self.global_batch,
                                                           self._world, self.probe_options, self.batch_arg_name,
                                                           self.state_key, fits=fits,
                                                           manual=not module.automatic_optimization)
        lightning_setattr(module, self.batch_arg_name, self.batch_size)
        check_limit(trainer, self.global_batch, self.accumulation, self.batch_size, None)
        check_validation(trainer, self.batch_size, self.probe_options["multiple_of"], None)
        if self.accumulation:
            trainer.accumulate_grad_batches = self.accumulation
        trainer.fit_loop._combined_loader = None  # the train dataloader is re-created at the restored size
        self._schedule.resize(trainer, self.batch_size)
        return True

    def _apply(self, trainer: Trainer, module: LightningModule, share: int | None, largest: int) -> tuple[int, int | None]:
        """Set the batch size (and accumulation) for a largest micro-batch; return them."""
        multiple, self._largest = self.probe_options["multiple_of"], largest
        size, accumulation = max(1, largest // multiple * multiple) if largest >= multiple else 0, None
        if share is not None and largest >= multiple:  # _check: multiple_of divides the share
            given = self._given[1] if self._given is not None else None
            split = split_keeping(self.global_batch, self._world, largest, given, multiple_of=multiple,
                                  setting="accumulate_grad_batches", where="the Trainer",
                                  probed=self.result.batch_size if self.result else None)
            accumulation, size, self._replaced = split.accumulation, split.size, split.warning
            self._fewer = split.fewer or self._fewer  # from the probe's answer (a confirmed size says nothing of larger ones)
            trainer.accumulate_grad_batches = accumulation
        if size >= 1:
            lightning_setattr(module, self.batch_arg_name, size)
        return size, accumulation

    def _given_accumulation(self, trainer: Trainer) -> None:
        """Note the ``accumulate_grad_batches`` the user gave ``trainer`` (kept by :meth:`_apply`
        where it splits ``global_batch`` into micro-batches that fit). A later fit on the same
        trainer finds the callback's own value there: the user's is the one noted first. The trainer is
        held weakly: a callback kept to read ``batch_size`` kept the trainer, the module and its
        optimizer alive after the user dropped them (review 38)."""
        current = trainer.accumulate_grad_batches
        if self._given is None or self._given[0]() is not trainer or current != self.accumulation:
            self._given = (weakref.ref(trainer), current)

    def _warn_replaced(self) -> None:
        """One warning where the user's ``accumulate_grad_batches`` was replaced (see
        :func:`~.global_batch.split_keeping`); an INFO line where it was kept though fewer fit; one warning
        where a checkpoint's samples per step change (:func:`.lightning_resume.changed_samples`)."""
        changed_samples(self._before, self.batch_size, self.accumulation or (self._given or (0, 1))[1], self._world)
        if self._replaced:
            rank_zero_warn(f"AutoBatchSize: {self._replaced}")
        elif self.global_batch is not None and self._fewer:
            tell("AutoBatchSize: kept the Trainer's accumulate_grad_batches=%d for global_batch=%d; the probe found "
                 "that %d micro-batch(es) a step would fit (remove accumulate_grad_batches from the Trainer to let "
                 "global_batch set it)",
                 self.accumulation, self.global_batch, self._fewer)

    def _warn_changed(self, trainer: Trainer, own: Any, share: int | None, samples: int | None,
                      drop_last: bool) -> None:
        """One warning where no ``global_batch`` was given and the size set changes the samples per
        optimizer step that the Trainer's own ``accumulate_grad_batches`` made with the module's own
        size (:func:`~.global_batch.changed_samples`): the accumulation is kept and the batch replaced,
        so ``4 x 4`` became ``147 x 4`` with only the INFO line naming the size; where the window no
        longer divides the epoch's batches, what Lightning steps on instead (:func:`.lightning_epochs.changed_step`);
        the same for a ``GradientAccumulationScheduler``'s windows (:func:`.lightning_epochs.scheduled_step`)."""
        for check in (changed_step, scheduled_step):  # Lightning refuses both at once: one applies
            if changed := share is None and check(trainer, own, self.batch_size, self._world, name=self.batch_arg_name,
                                                  samples=samples, drop_last=drop_last,
                                                  multiple_of=self.probe_options["multiple_of"]):
                rank_zero_warn(f"AutoBatchSize: {changed}")

    def _skip_probe(self, trainer: Trainer, module: LightningModule, share: int | None) -> None:
        """Under ``Trainer(fast_dev_run=...)``: no probe and no confirmation, one warning, as
        Lightning's ``BatchSizeFinder`` skips ("Skipping batch size scaler since `fast_dev_run` is
        enabled."). Why: a smoke test of a batch or a few should not spend the probe's trials and a
        confirmation run (the confirmation also printed "`Trainer.fit` stopped" before ``fit``).
        The module's own batch size trains; with ``global_batch``, taken as the largest that fits
        (or the Trainer's own ``accumulate_grad_batches``' micro-batch, where it splits the global
        batch), the accumulation is set as a probed run sets it (batch x accumulation x world size ==
        global_batch), so the smoke test runs the code path of the real run. The limit check is
        not made: ``fast_dev_run``'s few batches are the point. Nothing is saved in checkpoints."""
        own = lightning_getattr(module, self.batch_arg_name)
        self._skipped, self.batch_size, self.accumulation = True, own, None
        if share is not None and isinstance(own, int) and own >= 1:
            given = self._given[1] if self._given is not None else 1
            mine = share // given if given > 1 and share % given == 0 else 1  # the user's own split, unprobed
            largest = max(own, mine, self.probe_options["multiple_of"])
            self.batch_size, self.accumulation = self._apply(trainer, module, share, largest)
            trainer.fit_loop._combined_loader = None  # re-created at the size
            self._schedule.resize(trainer, self.batch_size)
        self._warn_replaced()
        rank_zero_warn(f"Skipping AutoBatchSize's probe since `fast_dev_run` is enabled: training at "
                       f"{self.batch_arg_name}={self.batch_size}" + (
                           f", accumulate_grad_batches={self.accumulation} for global_batch={self.global_batch}"
                           if self.accumulation else " (the module's own)"))

    def _confirm(self, trainer: Trainer, module: LightningModule, share: int | None, reset: Callable[[], None]) -> None:
        def apply(largest: int) -> tuple[int, int]:
            size, accumulation = self._apply(trainer, module, share, largest)
            return size, accumulation or trainer.accumulate_grad_batches

        self.confirmation = confirm_under_cap(
            trainer, self.batch_size, probed=self.result.batch_size, result=self.result, device=module.device,
            memory_limit=self.memory_limit, apply=apply, reset=reset, steps=self.confirm_steps,
            margin=self.probe_options["margin"])  # a step down keeps the room asked for
        self.batch_size, self.accumulation = self._apply(trainer, module, share, self.confirmation.batch_size)
        if self.confirmation.skipped:  # fit may not train at the size (no optimizer step in the run): said, not only noted
            rank_zero_warn(f"AutoBatchSize: {self.confirmation.summary()}")

