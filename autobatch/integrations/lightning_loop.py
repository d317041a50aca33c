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
epoch's end (:func:`.lightning_loop_state.training_batches`).
Everything is put back afterwards (the caller's snapshot: module, optimizers, scaler, random
states; here: loop progress, limits, callbacks, loggers, logged metrics).

If the loop runs out of memory, the next size comes from what was measured, not from halving:
the probe's memory line (bytes per sample from its passing trials) and the bytes the loop
needed beyond the probed step (a lower bound from the failure: memory in use when it failed plus
the allocation refused). A run that passes measures the loop's extra bytes exactly, and the
largest size the line allows with them is tried once more if it is larger. Memory the loop keeps
batch after batch (outputs gathered for an epoch-end metric) shows as allocations that rise at
every batch of the run: the smallest rise is carried to the end of the epoch ``fit`` will run.
Every size the measurements give has the probe's ``margin`` taken off, as ``find_max_batch``
takes it off its boundary (before, a step down filled the memory and dropped the room asked for).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from lightning.pytorch import Trainer

from ..memory.devices import DeviceMemory, memory_for
from ..memory.oom import free_memory, is_oom_error, requested_bytes
from ..memory.units import format_bytes
from ..probe.result import ProbeResult
from ..probe.searching.search import peak_limit
from .lightning_loop_state import _LoopState, quiet_stop, refuses_interval, training_batches

__all__ = ["confirm_under_cap", "LoopRun", "LoopConfirmation", "MemoryLine", "confirm_in_loop", "refuses_interval", "training_batches"]

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
    #: under manual optimization, the optimizers the run never stepped (their state unmeasured), else None
    unstepped: str | None = None


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
            f"{format_bytes(r.peak_bytes)}, {_extra(r)}"
            + (f", growing {format_bytes(r.growth_bytes)} a batch over {r.epoch_batches} batches" if r.growth_bytes else "")
            + (", then a validation batch" if r.validated else "")
            + f", {r.seconds:.2f}s)"
            for r in self.runs
        ])


def _extra(run: LoopRun) -> str:
    """The loop's bytes against the probed step, as words: ``+1.75 MiB beyond`` it, or ``267.95 KiB
    below`` it where the loop's peak stayed under the probe's line (a lower bound from a failed run:
    ``at least``, or ``at most ... below``). Why: a loop that needed less than the probed step was
    summarised as ``-267.95 KiB beyond the probed step``."""
    size = format_bytes(abs(run.extra_bytes))
    if run.extra_bytes >= 0:
        return f"{'' if run.passed else 'at least '}+{size} beyond the probed step"
    return f"{'' if run.passed else 'at most '}{size} below the probed step"


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


def confirm_under_cap(trainer: Trainer, size: int, *, probed: int, result: ProbeResult, device: Any,
                      memory_limit: int | None, apply: Callable[[int], tuple[int, int]], reset: Callable[[], None],
                      steps: int, margin: float) -> LoopConfirmation:
    """:func:`confirm_in_loop` on ``device`` under the probe's ``memory_limit``, stepping down along
    ``result``'s memory line: a fresh fit's answer and a resumed fit's kept size are confirmed alike."""
    with memory_for(device, memory_limit) as (memory, _):
        return confirm_in_loop(trainer, size, probed=probed, line=MemoryLine.of(result), memory=memory,
                               limit=peak_limit(memory, memory.capacity()), apply=apply, reset=reset, steps=steps,
                               margin=margin)


def confirm_in_loop(
    trainer: Trainer, size: int, *, probed: int, line: MemoryLine, memory: DeviceMemory, limit: int | None,
    apply: Callable[[int], tuple[int, int]], reset: Callable[[], None], steps: int, margin: float = 0.0,
) -> LoopConfirmation:
    """Run ``trainer``'s fit loop at ``size`` (then smaller, from the measurements, while it runs
    out of memory) and return what happened; ``apply(largest)`` sets the batch size (and
    accumulation) for a largest micro-batch and returns ``(micro-batch, accumulation)``;
    ``reset()`` puts module, optimizers, scaler and random states back. ``limit``: the largest
    allocated peak a passing run may reach (None: only an OOM fails). ``margin``: the probe's, taken
    off every size the measurements give (as ``find_max_batch`` takes it off its boundary): a step
    down filled the budget, and left none of the room the user asked for."""
    budget = limit if limit is not None else memory.capacity()

    def fits(extra: int) -> int:  # the largest size the line allows beside ``extra`` bytes, less the margin
        return int(line.largest(budget - extra) * (1.0 - margin))

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
        if run.passed and run.unstepped:  # a GAN's generator stepped at later batch indices: its state unmeasured
            confirmation.skipped = (f"the loop took too few steps of {run.unstepped} at {micro} (a manual-optimization "
                                    "training_step that steps it only at some batch indices): its steps' memory (the "
                                    "optimizer's state) was not measured; fit may run out of memory there; set max_batch")
            return confirmation
        if run.passed:  # the loop's extra bytes, measured: the largest size they allow, below any failure
            best, cut = micro, 0
            nxt = min(failed_below - 1, fits(run.extra_bytes))
        elif run.steps:  # ran its steps, over the limit by measured bytes (the growth carried to
            failed_below = min(failed_below, micro)  # the epoch's end, or its peak): no gallop
            nxt = min(micro - 1, fits(run.extra_bytes))
        else:  # at least the lower bound's cut; doubled while runs keep failing (a gallop down)
            failed_below = min(failed_below, micro)
            cut = max(1, micro - fits(run.extra_bytes), 2 * cut)
            nxt = micro - cut
            if nxt < 1 < micro:  # no size fits beside that many extra bytes: they grow with the batch (a
                # validation batch needing more a sample than training); scale by what the run needed
                room = budget * (1.0 - margin) / max(1, run.probe_bytes + run.extra_bytes)
                nxt = max(1, min(micro - 1, int(micro * room)))
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
        watch.optimizers(trainer, steps)
        with quiet_stop():  # the run's own max_steps: fit has not stopped
            loop.run()
        memory.synchronize()
        ran = trainer.global_step - first
        if 0 <= (loop.max_epochs if loop.max_epochs is not None else -1) <= trainer.current_epoch:
            watch.unstepped.clear()  # fit's own max_epochs ended the run: fit takes no step the run did not
    except BaseException as exc:  # noqa: BLE001 - re-raised below unless it is an OOM
        watch.unhook()
        if not is_oom_error(exc):
            saved.restore(trainer)
            reset()
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # the frames still hold the step's tensors; it needed more than the capacity, at least
        need = max(memory.allocated() + (requested_bytes(message) or 0), memory.capacity() + 1)
        error = message[:300]
    watch.unhook()
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
                   watch.validated, watch.unstepped_names(len(watch.allocated)))


class _BatchMemory:
    """A callback for a loop run: the bytes allocated after each training batch, and the
    batches an epoch has at this size (``trainer.num_training_batches``)."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory, self.allocated, self.batches, self.validated = memory, [], None, False
        self.first, self.bound = 0, 8  # the run's global_step at its start; batches it may take without a step
        self.unstepped: dict[int, list[Any]] = {}  # manual optimization: [name, steps left] of each optimizer
        self.hooks: list[Any] = []
        self.extended = 0  # batches the run took beyond its max_steps, waiting for one of those

    def optimizers(self, trainer: Trainer, steps: int) -> None:
        """Under manual optimization, watch every optimizer's first ``min(steps, 2)`` steps in the run
        (the second: the first whose forward and backward run beside the state the first made). Why: a
        ``training_step`` that steps one optimizer only at some batch indices (a WGAN's generator at
        ``(batch_idx + 1) % n_critic == 0``) took ``confirm_steps`` steps of the other and ended the run
        before the first step of the one, whose state (Adam's moments) was never measured: the
        callback set 1437 and ``fit`` ran out of memory at batch 4 (watching the first step only: 727,
        and at batch 9, the second, whose forward runs beside that state). The run now goes on, up to ``bound`` batches more, until each has
        stepped so (:meth:`on_train_batch_end`)."""
        if trainer.lightning_module.automatic_optimization or len(trainer.optimizers) < 2:
            return
        for index, optimizer in enumerate(trainer.optimizers):
            self.unstepped[id(optimizer)] = [f"optimizer {index} ({type(optimizer).__name__})", min(steps, 2)]
            self.hooks.append(optimizer.register_step_post_hook(self._stepped))

    def _stepped(self, optimizer: Any, *_: Any) -> None:
        left = self.unstepped.get(id(optimizer))
        if left is not None:
            left[1] -= 1
            if left[1] <= 0:
                del self.unstepped[id(optimizer)]

    def unhook(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def unstepped_names(self, batches: int) -> str | None:
        return f"{', '.join(name for name, _ in self.unstepped.values())} in {batches} batches" if self.unstepped else None

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        """Record; stop a run that took ``bound`` batches and no optimizer step (a manual
        ``training_step`` stepping at odd batch indices, epochs of one batch at this size: it looped forever)."""
        self.allocated.append(self.memory.allocated())
        self.batches = trainer.num_training_batches
        loop = trainer.fit_loop.epoch_loop
        if self.unstepped and trainer.global_step >= loop.max_steps and self.extended < self.bound:
            loop.max_steps, self.extended = trainer.global_step + 1, self.extended + 1  # one batch more (restored after)
        trainer.should_stop = trainer.should_stop or (len(self.allocated) >= self.bound and trainer.global_step == self.first)

    def on_validation_batch_end(self, *_: Any) -> None:
        self.validated = True

    def growth(self) -> int | None:
        """Bytes a batch adds, where every batch after the first left more allocated than the one
        before (the smallest rise: the least the loop keeps per batch); None otherwise."""
        rises = [b - a for a, b in zip(self.allocated[1:], self.allocated[2:])]
        return min(rises) if rises and all(rise > 0 for rise in rises) else None
