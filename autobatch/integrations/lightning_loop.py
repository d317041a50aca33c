"""Confirming :class:`~autobatch.integrations.lightning.AutoBatchSize`'s answer in Lightning's own fit loop.

The probe times a step that does what Lightning's loop does, but a loop holds what a step cannot
know of (what callbacks and hooks keep, the fetcher, logging). So after the probe the callback
runs a few optimizer steps of the trainer's real ``fit_loop`` at the answer, as Lightning's
``BatchSizeFinder`` runs its trials (``_try_loop_run``: the loop's state dict loaded back, the
loop run with ``max_steps`` steps, callbacks and loggers set aside), and measures the loop's
allocated peak. Where ``fit`` validates, the run ends with one validation batch, as the loop
runs it mid-training (gradients dropped, the optimizer's state alive): a val dataloader built
from the batch size (often twice it, with no gradients to keep) is checked at the same size. It also
validates where ``fit`` would within the run (an epoch's end it crosses: an epoch-end
``ReduceLROnPlateau`` reads the ``val_loss`` logged there, and failed without it); at a size
whose epoch is shorter than an integer ``val_check_interval``, which Lightning refuses, at each
epoch's end (:func:`training_batches`).
Everything is put back afterwards (the caller's snapshot: module, optimizers, scaler, random
states; here: loop progress, limits, callbacks, loggers, logged metrics).

If the loop runs out of memory, the next size comes from what was measured, not from halving:
the probe's memory line (bytes per sample from its passing trials) and the bytes the loop
needed beyond the probed step (a lower bound from the failure: memory in use when it failed plus
the allocation refused). A run that passes measures the loop's extra bytes exactly, and the
largest size the line allows with them is tried once more if it is larger. Memory the loop keeps
batch after batch (outputs gathered for an epoch-end metric) shows as allocations that rise at
every batch of the run: the smallest rise is carried to the end of the epoch ``fit`` will run.
"""

from __future__ import annotations

import time
from copy import deepcopy
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from lightning.pytorch import Trainer

from ..memory.devices import DeviceMemory
from ..memory.oom import free_memory, is_oom_error, requested_bytes
from ..memory.units import format_bytes
from ..probe.result import ProbeResult

__all__ = ["LoopRun", "LoopConfirmation", "MemoryLine", "confirm_in_loop", "refuses_interval", "training_batches"]

#: The most loop runs a confirmation makes .
MAX_RUNS = 6


@dataclass
class LoopRun:
    """One run of Lightning's fit loop at ``batch_size`` for ``steps`` optimizer steps.

    ``peak_bytes``: the loop's allocated peak (a failed run: the peak before the OOM);
    ``probe_bytes``: the probe's memory line at this size; ``extra_bytes``: what the loop needed
    beyond the probed step (a passed run: measured, with the growth carried to the epoch's end; a
    failed run: a lower bound); ``steps``: the optimizer steps the loop took."""

    batch_size: int
    passed: bool
    steps: int
    peak_bytes: int
    probe_bytes: int
    extra_bytes: int
    seconds: float
    error: str | None = None
    #: bytes still allocated after each batch beyond the last (memory the loop keeps batch after
    #: batch, as outputs gathered for an epoch-end metric), and the batches of the epoch it was
    #: carried to; None where the allocations did not grow at every batch
    growth_bytes: int | None = None
    epoch_batches: int | None = None
    #: the run ended with a validation batch at this size (the module validates in fit)
    validated: bool = False


@dataclass
class LoopConfirmation:
    """What the confirmation did: ``batch_size`` passed ``runs[-k]`` in the real loop (or
    ``skipped`` says why no run was made); ``probed`` was the probe's size."""

    batch_size: int
    probed: int
    limit_bytes: int | None
    runs: list[LoopRun] = field(default_factory=list)
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One paragraph: why the size is safe."""
        if self.skipped:
            return f"batch {self.batch_size} from the probe, not confirmed in Lightning's loop: {self.skipped}"
        return (f"batch {self.batch_size} trained in Lightning's own fit loop under "
                f"{format_bytes(self.limit_bytes) if self.limit_bytes else 'the device memory'} (probe: {self.probed}); runs: "
                + self.runs_summary())

    def runs_summary(self) -> str:
        """What each run in the loop did (passed or ran out of memory, its steps and peaks)."""
        return "; ".join([
            f"{'passed' if r.passed else 'OOM'} at {r.batch_size} ({r.steps} steps, loop peak "
            f"{format_bytes(r.peak_bytes)}, {'+' if r.extra_bytes >= 0 else '-'}{format_bytes(abs(r.extra_bytes))} "
            f"{'beyond' if r.passed else 'at least beyond'} the probed step"
            + (f", growing {format_bytes(r.growth_bytes)} a batch over {r.epoch_batches} batches" if r.growth_bytes else "")
            + (", then a validation batch" if r.validated else "")
            + f", {r.seconds:.2f}s)"
            for r in self.runs
        ])


@dataclass(frozen=True)
class MemoryLine:
    """The probe's step peak as a line in the batch size: ``intercept + slope * batch``."""

    slope: float
    intercept: float

    def at(self, batch_size: int) -> int:
        return int(self.intercept + self.slope * batch_size)

    def largest(self, budget: float) -> int:
        """The largest batch whose line stays within ``budget`` bytes (0 if none)."""
        return max(0, int((budget - self.intercept) // self.slope)) if self.slope > 0 else 0

    @classmethod
    def of(cls, result: ProbeResult) -> "MemoryLine":
        """From the probe's passing trials (their last step's peak, a steady-state step): the two
        largest sizes; with one, the line through zero (steeper: it cuts too little, never too much)."""
        peaks: dict[int, int] = {}
        for trial in result.trials:
            peak = trial.step_peak_bytes if trial.step_peak_bytes is not None else trial.peak_bytes
            if trial.passed and peak is not None:
                peaks[trial.batch_size] = peak
        sizes = sorted(peaks)[-2:]
        if not sizes:
            raise ValueError("AutoBatchSize: the probe has no passing trial to read a memory line from")
        if len(sizes) == 1 or peaks[sizes[1]] <= peaks[sizes[0]]:
            return cls(peaks[sizes[-1]] / sizes[-1], 0.0)
        slope = (peaks[sizes[1]] - peaks[sizes[0]]) / (sizes[1] - sizes[0])
        return cls(slope, peaks[sizes[1]] - slope * sizes[1])


def confirm_in_loop(
    trainer: Trainer, size: int, *, probed: int, line: MemoryLine, memory: DeviceMemory, limit: int | None,
    apply: Callable[[int], tuple[int, int]], reset: Callable[[], None], steps: int,
) -> LoopConfirmation:
    """Run ``trainer``'s fit loop at ``size`` (then smaller, from the measurements, while it runs
    out of memory) and return what happened; ``apply(largest)`` sets the batch size (and
    accumulation) for a largest micro-batch and returns ``(micro-batch, accumulation)``;
    ``reset()`` puts module, optimizers, scaler and random states back. ``limit``: the largest
    allocated peak a passing run may reach (None: only an OOM fails)."""
    budget = limit if limit is not None else memory.capacity()
    confirmation = LoopConfirmation(batch_size=size, probed=probed, limit_bytes=budget)
    best, failed_below, cut = None, probed + 1, 0
    largest = size
    while len(confirmation.runs) < MAX_RUNS:
        micro, accumulation = apply(largest)
        if micro < 1 or (best is not None and micro <= best):
            break
        run = _run_loop(trainer, micro, steps if accumulation == 1 else 2, line, memory, limit, reset)
        confirmation.runs.append(run)
        if run.passed and run.steps == 0:  # nothing measured: the answer stands unconfirmed
            confirmation.skipped = (f"the loop took no optimizer step at {micro}: a train "
                                    "dataloader with no full batch at that size, or a manual-optimization "
                                    "training_step that steps only at some batch indices the epoch at that size lacks? "
                                    "fit may train nothing there; set max_batch")
            return confirmation
        if run.passed:  # the loop's extra bytes, measured: the largest size they allow, below any failure
            best, cut = micro, 0
            nxt = min(failed_below - 1, line.largest(budget - run.extra_bytes))
        elif run.steps:  # ran its steps, over the limit by measured bytes (the growth carried to
            failed_below = min(failed_below, micro)  # the epoch's end, or its peak): no gallop
            nxt = min(micro - 1, line.largest(budget - run.extra_bytes))
        else:  # at least the lower bound's cut; doubled while runs keep failing (a gallop down)
            failed_below = min(failed_below, micro)
            cut = max(1, micro - line.largest(budget - run.extra_bytes), 2 * cut)
            nxt = micro - cut
            if nxt < 1 < micro:  # no size fits beside that many extra bytes: they grow with the batch (a
                # validation batch needing more a sample than training); scale by what the run needed
                nxt = max(1, min(micro - 1, int(micro * budget / max(1, run.probe_bytes + run.extra_bytes))))
        if nxt < 1 or nxt <= (best or 0) or nxt == largest:
            break
        largest = nxt
    if best is None:
        raise MemoryError(
            f"AutoBatchSize: no batch size trained in Lightning's fit loop (probe: {confirmation.probed}; runs: "
            f"{confirmation.runs_summary()}); "
            "the loop needs more memory than the probed step at every size: lower what the loop keeps "
            "(callbacks, logged tensors) or what one validation batch needs, or give it more memory"
        )
    apply(best)
    confirmation.batch_size = best
    return confirmation


def _run_loop(trainer: Trainer, size: int, steps: int, line: MemoryLine, memory: DeviceMemory,
              limit: int | None, reset: Callable[[], None]) -> LoopRun:
    """``steps`` optimizer steps of the real fit loop at ``size``; state put back afterwards."""
    loop = trainer.fit_loop
    saved = _LoopState.take(trainer)
    error, need = None, 0  # need: what a failed run needed at least
    memory.release_cached()
    memory.reset_peak()
    began = time.perf_counter()
    watch = _BatchMemory(memory)
    try:
        saved.prepare(trainer, steps, watch)
        first = watch.first = trainer.global_step
        watch.bound = max(8, 4 * steps * trainer.accumulate_grad_batches)
        loop.run()
        memory.synchronize()
        ran = trainer.global_step - first
    except BaseException as exc:  # noqa: BLE001 - re-raised below unless it is an OOM
        if not is_oom_error(exc):
            saved.restore(trainer)
            reset()
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # the frames still hold the step's tensors; it needed more than the capacity, at least
        need = max(memory.allocated() + (requested_bytes(message) or 0), memory.capacity() + 1)
        error = message[:300]
    seconds = time.perf_counter() - began
    peak = memory.peak()
    growth, batches = watch.growth(), saved.epoch_batches(watch.batches, trainer.accumulate_grad_batches, watch.first)
    saved.restore(trainer)
    reset()
    ahead = 0 if growth is None or batches is None else growth * max(0, batches - len(watch.allocated))
    if error is not None:
        ran = 0
        free_memory()  # outside the except block: the traceback no longer pins the failed step
    elif (limit is not None or ahead) and peak + ahead > (ceiling := limit if limit is not None else memory.capacity()):
        error = (f"too close to the capacity: loop peak {format_bytes(peak)}"
                 + (f" and {format_bytes(ahead)} more kept by the epoch's end" if ahead else "")
                 + f" above {format_bytes(ceiling)}")
        need = peak + ahead
    memory.release_cached()  # training (or the next run) starts from an emptied cache, as after the probe
    probe = line.at(size)
    extra = (peak + ahead if error is None else need) - probe
    return LoopRun(size, error is None, ran, peak, probe, extra, seconds, error, growth, batches if growth else None,
                   watch.validated)


class _BatchMemory:
    """A callback for a loop run: the bytes allocated after each training batch, and the
    batches an epoch has at this size (``trainer.num_training_batches``)."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory, self.allocated, self.batches, self.validated = memory, [], None, False
        self.first, self.bound = 0, 8  # the run's global_step at its start; batches it may take without a step

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        """Record; stop a run that took ``bound`` batches and no optimizer step (a manual
        ``training_step`` stepping at odd batch indices, epochs of one batch at this size: it looped forever)."""
        self.allocated.append(self.memory.allocated())
        self.batches = trainer.num_training_batches
        trainer.should_stop = trainer.should_stop or (len(self.allocated) >= self.bound and trainer.global_step == self.first)

    def on_validation_batch_end(self, *_: Any) -> None:
        self.validated = True

    def growth(self) -> int | None:
        """Bytes a batch adds, where every batch after the first left more allocated than the one
        before (the smallest rise: the least the loop keeps per batch); None otherwise."""
        rises = [b - a for a, b in zip(self.allocated[1:], self.allocated[2:])]
        return min(rises) if rises and all(rise > 0 for rise in rises) else None


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


