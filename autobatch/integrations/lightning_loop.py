"""Confirming :class:`~autobatch.integrations.lightning.AutoBatchSize`'s answer in Lightning's own fit loop.

The probe times a step that does what Lightning's loop does, but a loop holds what a step cannot
know of (what callbacks and hooks keep, the fetcher, logging). So after the probe the callback
runs a few optimizer steps of the trainer's real ``fit_loop`` at the answer, as Lightning's
``BatchSizeFinder`` runs its trials (``_try_loop_run``: the loop's state dict loaded back, the
loop run with ``max_steps`` steps, callbacks and loggers set aside), and measures the loop's
allocated peak. Everything is put back afterwards (the caller's snapshot: module, optimizers,
scaler, random states; here: loop progress, limits, callbacks, loggers, logged metrics).

If the loop runs out of memory, the next size comes from what was measured, not from halving:
the probe's memory line (bytes per sample from its passing trials) and the bytes the loop
needed beyond the probed step (a lower bound from the failure: memory in use when it failed plus
the allocation refused). A run that passes measures the loop's extra bytes exactly, and the
largest size the line allows with them is tried once more if it is larger.
"""

from __future__ import annotations

import re
import time
from copy import deepcopy
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from lightning.pytorch import Trainer

from ..memory.devices import DeviceMemory
from ..memory.oom import free_memory, is_oom_error
from ..memory.units import format_bytes, parse_bytes
from ..probe.result import ProbeResult

__all__ = ["LoopRun", "LoopConfirmation", "MemoryLine", "confirm_in_loop"]

#: The most loop runs a confirmation makes .
MAX_RUNS = 6

_REQUESTED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?([KMGT]i?B|B|bytes)")


@dataclass
class LoopRun:
    """One run of Lightning's fit loop at ``batch_size`` for ``steps`` optimizer steps.

    ``peak_bytes``: the loop's allocated peak (a failed run: the peak before the OOM);
    ``probe_bytes``: the probe's memory line at this size; ``extra_bytes``: what the loop needed
    beyond the probed step (a passed run: measured; a failed run: a lower bound)."""

    batch_size: int
    passed: bool
    steps: int
    peak_bytes: int
    probe_bytes: int
    extra_bytes: int
    seconds: float
    error: str | None = None


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
        parts = [
            f"{'passed' if r.passed else 'OOM'} at {r.batch_size} ({r.steps} steps, loop peak "
            f"{format_bytes(r.peak_bytes)}, {'+' if r.extra_bytes >= 0 else '-'}{format_bytes(abs(r.extra_bytes))} "
            f"{'beyond' if r.passed else 'at least beyond'} the probed step, {r.seconds:.2f}s)"
            for r in self.runs
        ]
        return (f"batch {self.batch_size} trained in Lightning's own fit loop under "
                f"{format_bytes(self.limit_bytes) if self.limit_bytes else 'the device memory'} (probe: {self.probed}); runs: "
                + "; ".join(parts))


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
        if run.passed:  # the loop's extra bytes, measured: the largest size they allow, below any failure
            best, cut = micro, 0
            nxt = min(failed_below - 1, line.largest(budget - run.extra_bytes))
        else:  # at least the lower bound's cut; doubled while runs keep failing (a gallop down)
            failed_below = min(failed_below, micro)
            cut = max(1, micro - line.largest(budget - run.extra_bytes), 2 * cut)
            nxt = micro - cut
        if nxt < 1 or nxt <= (best or 0) or nxt == largest:
            break
        largest = nxt
    if best is None:
        raise MemoryError(
            f"AutoBatchSize: no batch size trained in Lightning's fit loop (runs: {confirmation.summary()}); "
            "the loop needs more memory than the probed step at every size: lower what the loop keeps "
            "(callbacks, logged tensors) or give it more memory"
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
    try:
        saved.prepare(trainer, steps)
        loop.run()
        memory.synchronize()
    except BaseException as exc:  # noqa: BLE001 - re-raised below unless it is an OOM
        if not is_oom_error(exc):
            saved.restore(trainer)
            reset()
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # the frames still hold the step's tensors; it needed more than the capacity, at least
        need = max(memory.allocated() + (_requested(message) or 0), memory.capacity() + 1)
        error = message[:300]
    seconds = time.perf_counter() - began
    peak = memory.peak()
    saved.restore(trainer)
    reset()
    if error is not None:
        free_memory()  # outside the except block: the traceback no longer pins the failed step
    elif limit is not None and peak > limit:
        error = f"too close to the capacity: loop peak {format_bytes(peak)} above {format_bytes(limit)}"
        need = peak
    memory.release_cached()  # training (or the next run) starts from an emptied cache, as after the probe
    probe = line.at(size)
    extra = (peak if error is None else need) - probe
    return LoopRun(size, error is None, steps, peak, probe, extra, seconds, error)


@dataclass
class _LoopState:
    """What a loop run changes on the trainer, as ``BatchSizeFinder`` dumps and restores it."""

    loop_state: dict[str, Any]
    callbacks: list[Any]
    loggers: list[Any]
    max_steps: int
    limit_train_batches: Any
    limit_val_batches: Any

    @classmethod
    def take(cls, trainer: Trainer) -> "_LoopState":
        return cls(deepcopy(trainer.fit_loop.state_dict()), trainer.callbacks, trainer.loggers,
                   trainer.fit_loop.epoch_loop.max_steps, trainer.limit_train_batches, trainer.limit_val_batches)

    def prepare(self, trainer: Trainer, steps: int) -> None:
        from lightning.pytorch.loggers.logger import DummyLogger

        trainer.callbacks = []  # no checkpoint, progress bar or user callback runs during the check
        trainer.logger = DummyLogger() if trainer.logger is not None else None
        trainer.limit_train_batches, trainer.limit_val_batches = 1.0, 0
        loop = trainer.fit_loop
        loop.epoch_loop.max_steps = steps
        loop.load_state_dict(deepcopy(self.loop_state))
        loop.restarting = False
        loop._combined_loader = None  # built at the size just set

    def restore(self, trainer: Trainer) -> None:
        trainer.callbacks, trainer.loggers = self.callbacks, self.loggers
        trainer.limit_train_batches, trainer.limit_val_batches = self.limit_train_batches, self.limit_val_batches
        loop = trainer.fit_loop
        loop.epoch_loop.max_steps = self.max_steps
        loop.load_state_dict(deepcopy(self.loop_state))
        loop.restarting = False
        loop._combined_loader = None
        loop.epoch_loop.val_loop._combined_loader = None
        trainer._logger_connector.reset_results()
        trainer._logger_connector.reset_metrics()
        trainer.should_stop = False


def _requested(message: str) -> int | None:
    match = _REQUESTED.search(message)
    if match is None:
        return None
    unit = "B" if match.group(2) == "bytes" else match.group(2)
    try:
        return parse_bytes(f"{match.group(1)}{unit}")
    except ValueError:
        return None
