"""Candidate plans for a global batch, and timing them in samples per second.

A candidate is (micro-batch, accumulation steps, checkpointing). Timing one runs real global
steps through :func:`~autobatch.accumulation.accumulated_step` (the same loop training uses):
``warmup_steps`` untimed, then ``timed_steps`` each timed on its own, with a device
synchronisation before each clock reading. Samples/s = ``global_batch / fastest step``: like
``timeit``, the minimum is the figure least disturbed by other load (``step_seconds`` keeps
them all). The model and
optimizer are put back bit-exactly after every candidate (:class:`~autobatch.restore.Snapshot`),
so each starts from the same state and the user's model is untouched afterwards. A candidate
that runs out of memory while timed is recorded with its error and never chosen.

The clock is injectable (``timer``) so tests can give steps a known, deterministic cost.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from .accumulation import accumulated_step, micro_batch_sizes
from .oom import free_memory, is_oom_error
from .restore import Snapshot

__all__ = ["Candidate", "candidate_micro_batches", "balanced_micro_batch", "measure_candidates"]

log = logging.getLogger("autobatch")


@dataclass
class Candidate:
    """One way to run the global batch, and what timing it measured.

    ``micro_batch_sizes`` are the sizes of the ``accumulation_steps`` micro-batches (they
    cover the global batch exactly). ``seconds_per_step`` is the fastest timed global step,
    ``step_seconds`` all of them. ``samples_per_s`` is None until measured, or when the
    candidate failed (``error`` says why).
    """

    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    micro_batch_sizes: list[int]
    samples_per_s: float | None = None
    seconds_per_step: float | None = None
    step_seconds: list[float] | None = None
    error: str | None = None
    chosen: bool = False

    @classmethod
    def build(cls, global_batch: int, micro_batch: int, checkpointing: bool, *, balanced: bool = True) -> "Candidate":
        sizes = micro_batch_sizes(global_batch, micro_batch, balanced=balanced)
        return cls(max(sizes), len(sizes), checkpointing, sizes)

    @property
    def key(self) -> tuple[int, int, bool]:
        return (self.micro_batch, self.accumulation_steps, self.checkpointing)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def balanced_micro_batch(global_batch: int, largest: int) -> int:
    """The smallest micro-batch that needs no more steps than ``largest`` does:
    ``ceil(global / ceil(global / largest))`` (64 with at most 24 fitting: 3 steps of 22, 21, 21)."""
    return math.ceil(global_batch / math.ceil(global_batch / largest))


def candidate_micro_batches(
    global_batch: int, largest: int, *, smallest: int | None = None, multiple_of: int = 1
) -> list[int]:
    """Micro-batch sizes worth timing when at most ``largest`` fits: the powers of two from
    ``smallest`` (default ``largest // 16``, at least 1) up to ``largest``, and ``largest``
    itself; none above ``global_batch``; one per number of accumulation steps, ascending.

    Sizes that need the same number of steps do the same number of micro-steps, so only the
    smallest such size (:func:`balanced_micro_batch`, the least padding) is kept. With
    ``multiple_of`` > 1 every size is a multiple of it and the largest per step count is kept
    (a balanced split would break the multiple).
    """
    largest = min(largest, global_batch)
    low = max(1, largest // 16) if smallest is None else max(1, smallest)
    sizes = {largest}
    power = 1
    while power <= largest:
        if power >= low:
            sizes.add(power)
        power *= 2
    if multiple_of > 1:
        sizes = {size for size in sizes if size % multiple_of == 0} or {largest}
    by_steps: dict[int, int] = {}
    for size in sorted(sizes):
        steps = math.ceil(global_batch / size)
        by_steps[steps] = size if multiple_of > 1 else balanced_micro_batch(global_batch, size)
    return sorted(set(by_steps.values()))


def measure_candidates(
    step: Any,
    candidates: list[Candidate],
    *,
    global_batch: int,
    warmup_steps: int = 1,
    timed_steps: int = 3,
    timer: Callable[[], float],
    synchronize: Callable[[], None] = lambda: None,
) -> None:
    """Time each candidate in place (``samples_per_s``, ``seconds_per_step``, ``error``).

    ``step`` is a :class:`~autobatch.TrainStep`; its ``make_batch`` builds each micro-batch.
    The model must already be in the candidates' checkpointing state (the planner arranges
    that); model and optimizer are restored after each candidate.
    """
    snapshot = Snapshot.take(step.model, step.optimizer)
    try:
        for candidate in candidates:
            error = _time(step, candidate, global_batch, warmup_steps, timed_steps, timer, synchronize)
            if error is not None:
                step.clear_grads()
                free_memory()
                candidate.error = error
                log.info("candidate %s ran out of memory while timed: %s", candidate.key, error)
            snapshot.restore()
    finally:
        snapshot.restore()


def _time(step, candidate, global_batch, warmup_steps, timed_steps, timer, synchronize) -> str | None:
    """Run and time the candidate; return None, or the OOM's first line (outside ``except``)."""

    def one_step() -> None:
        micro = (step.make_batch(size) for size in candidate.micro_batch_sizes)
        accumulated_step(step, micro, global_batch=global_batch)

    times: list[float] = []
    try:
        for _ in range(warmup_steps):
            one_step()
        synchronize()
        for _ in range(timed_steps):
            began = timer()
            one_step()
            synchronize()
            times.append(timer() - began)
    except BaseException as exc:  # noqa: BLE001 - re-raised unless it is an OOM
        if not is_oom_error(exc):
            raise
        text = str(exc).strip()
        return text.splitlines()[0][:300] if text else type(exc).__name__
    fastest = min(times)
    candidate.step_seconds = times
    candidate.seconds_per_step = fastest
    candidate.samples_per_s = global_batch / fastest if fastest > 0 else math.inf
    log.info(
        "candidate micro=%d x %d checkpointing=%s: %.1f samples/s",
        candidate.micro_batch,
        candidate.accumulation_steps,
        candidate.checkpointing,
        candidate.samples_per_s,
    )
    return None


def accelerator_synchronize(device: torch.device) -> Callable[[], None]:
    """A synchronise function for ``device`` (a no-op on the CPU)."""
    if device.type == "cpu":
        return lambda: None
    return lambda: torch.accelerator.synchronize(device)
