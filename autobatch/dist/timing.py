"""The planner's timing and accumulated probe across ranks: the runner's own step, in lockstep.

``objective="throughput"`` times candidate plans by running real global steps, and the planner
probes the largest micro-batch of an *accumulated* step (two micro-batches, the first one's
gradients held through the second). On a DDP or FSDP2 model each of those steps enters
collectives (DDP's bucket all-reduce, FSDP's all-gathers and reduce-scatters), so a rank that
ran out of memory, or stopped timing a candidate its peer went on with, left the peer waiting
in one (gloo aborted, or the job hung).

Both now run each global step through the runner's data-parallel step
(:class:`~autobatch.dist.fsdp.FsdpDataParallel`: FSDP2's voted step, DDP's reducer with the
bucket-completion protocol, or the local module with one agreed all-reduce), whose contract is
that an OOM on any rank raises an OOM on every rank once every collective it began is complete
(:class:`~autobatch.errors.PeerOutOfMemoryError` on the others). The ranks thus fail a step
together, and :mod:`autobatch.planning.throughput` agrees the rest (pruning, each candidate's
outcome and step times) through :func:`~autobatch.distributed.exchange`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from ..planning.accumulation import AccumulatingStep, LazyMicroBatches
from ..probe.train_step import TrainStep
from .ddp_probe import _tracing_fakes
from .fsdp import FsdpDataParallel

__all__ = ["lockstep_runner", "LockstepAccumulatingStep"]


def lockstep_runner(step: TrainStep, what: str) -> Callable[[list[int]], None]:
    """``run(sizes)``: one global step of ``step`` over micro-batches of ``sizes`` (built one at
    a time by ``step.make_batch``), through the runner's data-parallel step, on every rank;
    any rank's OOM is an OOM on every rank. ``what`` names the steps' sync points."""
    parallel = FsdpDataParallel()
    model = parallel.local_module(step.model)  # DDP itself where its reducer is driven, FSDP2 as is
    local = TrainStep(model, step.optimizer, step.loss_fn, step.make_batch, **step.options())
    calls = [0]

    def run(sizes: list[int]) -> None:
        calls[0] += 1
        where = ["forward"]
        label = f"{what} step {calls[0]} ({len(sizes)} x {max(sizes)})"
        parallel.step(
            local, LazyMicroBatches(list(sizes), step.make_batch), local_size=sum(sizes),
            on_phase=lambda phase: where.__setitem__(0, phase), phase=lambda: where[0], label=label,
        )
        parallel.after_step(model, label)  # rank 0's buffers, where the wrapper does not send them

    return run


class LockstepAccumulatingStep(AccumulatingStep):
    """The planner's accumulated probe step (two micro-batches of the size asked for) on a
    DDP or FSDP2 model, run through :func:`lockstep_runner` so that a trial that runs out of
    memory on one rank fails on every rank. Before, the probe swapped it for its one-batch
    DDP / FSDP step, and the accumulated answer was the one-step answer."""

    lockstep = True  # every call runs collectives: ranks make the same calls (ProbeAgreement.settle_more)

    def __init__(self, step: TrainStep) -> None:
        super().__init__(step)
        self._run = lockstep_runner(step, "probe accumulated")

    def __call__(self, batch_size: int) -> None:
        if _tracing_fakes():  # the estimator's fake tracing: no collective can run, the local module is traced
            local = copy.copy(self)
            local.model = getattr(self.model, "module", self.model)
            AccumulatingStep.__call__(local, batch_size)
            return
        self._run([batch_size, batch_size])


def timed_step(step: Any) -> Callable[[list[int]], None]:
    """The planner's timing step for ``step`` (:class:`~autobatch.probe.ranks.ProbeAgreement`'s
    ``timed_step``)."""
    return lockstep_runner(step, "plan timing")
