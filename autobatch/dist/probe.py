"""The probe under ``torch.distributed``: every rank probes its own device, in lockstep.

:func:`~autobatch.find_max_batch` calls these hooks when :func:`~autobatch.distributed.is_distributed`
is true, so ``torchrun`` jobs need no extra argument. Each rank runs every trial on its own
device; then the ranks agree on the outcome (one sync point per trial):

* a trial passes only if it passed on **every** rank, so a rank whose trial passed never
  moves on while another ran out of memory;
* the measured peaks are the **largest** over the ranks, and the capacity the **smallest**,
  so the predictive search fits the same line everywhere;
* the search strategies are deterministic functions of these agreed answers, so every rank
  proposes the same next size, and the chosen batch is the same on every rank; the final
  answer is still passed through an all-reduce MIN as a safety net.

A ``TrainStep`` whose model is a DDP module that :func:`~autobatch.dist.ddp_step.ddp_supported`
accepts is probed through DDP itself (:class:`DDPProbeStep`): the real DDP step, buckets,
their all-reduce and the buffer broadcast included, so the measured peak is the one DDP
training reaches. Its collectives follow the runner's protocol (:mod:`autobatch.dist.ddp_step`):
a rank that runs out of memory completes its peers' buckets with zeros, and every rank votes
after the gradients and after the optimizer step, so every rank fails a trial step together
and none waits in a collective alone. Any other wrapper (anything with a ``.module`` that is
an ``nn.Module`` and a ``no_sync``) is probed on its local module (:func:`local_step`). Such a
step, a plain module's and a plain callable run no collective and cast no vote: a rank whose
probe raises an error that is not an OOM tells its peers before it re-raises it
(:meth:`CollectiveProbeAgreement.left`, :mod:`~autobatch.dist.leaving`), and they raise
:class:`~autobatch.errors.PeerFailedError` at their next sync point (the trial's agreement) at once. The
planner's accumulated probe (:class:`~autobatch.planning.accumulation.AccumulatingStep`) on a
wrapped model keeps its two micro-batches, run through the runner's step
(:class:`~autobatch.dist.timing.LockstepAccumulatingStep`). A plain callable that runs collectives is the caller's responsibility;
a rank stuck that way ends in :class:`~autobatch.errors.RankDisagreementError` after the sync
timeout, not in a silent hang.
"""

from __future__ import annotations

import math
from typing import Any


from ..probe.ranks import ProbeAgreement
from ..training.ranks import differing, unwrap
from ..probe.trial import TrialRecord
from . import agreement as dist_sync
from .leaving import leave

__all__ = [
    "CollectiveProbeAgreement", "agree_trial", "agree_capacity", "agree_prior", "agree_cache_hit", "agree_batch", "agree_plan", "local_step", "unwrap",
]


def local_step(fn: Any) -> Any:
    """``fn``; for a ``TrainStep`` on a DDP model the DDP step (:class:`DDPProbeStep`), or on
    another data-parallel wrapper the same step on the local module."""
    from ..planning.accumulation import AccumulatingStep
    from ..probe.train_step import TrainStep
    from .ddp_probe import DDPProbeStep
    from .ddp_step import check_whole_world, ddp_supported
    from .forward_collectives import refuse_fsdp1, warn_forward_collectives
    from .timing import LockstepAccumulatingStep

    if isinstance(fn, TrainStep):
        check_whole_world(fn.model)  # a DDP over a sub-group: refused before any trial
        refuse_fsdp1(fn.model)  # its inner module's trials would fail in autograd
        warn_forward_collectives(fn.model)
    if isinstance(fn, AccumulatingStep) and not isinstance(fn, LockstepAccumulatingStep) and unwrap(fn.model) is not fn.model:
        return LockstepAccumulatingStep(fn)  # the planner's accumulated probe: two micro-batches, not one
    if isinstance(fn, TrainStep) and not isinstance(fn, DDPProbeStep) and ddp_supported(fn.model):
        return DDPProbeStep(fn)
    if isinstance(fn, TrainStep) and unwrap(fn.model) is not fn.model:
        return TrainStep(
            unwrap(fn.model), fn.optimizer, fn.loss_fn, fn.make_batch, **fn.options()
        )
    return fn


def agree_trial(record: TrialRecord) -> TrialRecord:
    """The trial's outcome over all ranks: passed only where every rank passed; the largest
    peaks (and resident memory). A rank whose own trial passed records the failure as another
    rank's."""
    rows = dist_sync.exchange(
        [int(record.passed), _int(record.peak_bytes), _int(record.reserved_bytes),
         _int(record.step_peak_bytes), _int(record.resident_bytes), _int(record.over_bytes), _int(record.wall_bytes),
         _int(record.flushes), int(record.flushed_out)],
        f"probe trial ({record.purpose}) at batch {record.batch_size}",
    )
    failed = [other for other, row in enumerate(rows) if not row[0]]
    record.passed = not failed
    if failed and record.error is None:
        record.error = f"out of memory on rank {', '.join(map(str, failed))}"
    record.peak_bytes = _none(max(row[1] for row in rows))
    record.reserved_bytes = _none(max(row[2] for row in rows))
    # a figure some rank lacks is lacking for all, so every rank fits the same line
    record.step_peak_bytes = None if min(row[3] for row in rows) < 0 else max(row[3] for row in rows)
    record.resident_bytes = None if min(row[4] for row in rows) < 0 else max(row[4] for row in rows)
    record.over_bytes = _none(max(row[5] for row in rows))  # the rank furthest over its wall
    record.wall_bytes = _none(max(row[6] for row in rows))  # the most a rank's allocator held in pieces
    # the search reads both below a size that kept flushing: every rank must read the same
    record.flushes, record.flushed_out = _none(max(row[7] for row in rows)), any(row[8] for row in rows)
    return record


def agree_capacity(capacity: int | None) -> int | None:
    """The smallest capacity over the ranks (None when some rank does not know its own)."""
    rows = dist_sync.exchange([_int(capacity)], "probe capacity")
    values = [row[0] for row in rows]
    return None if min(values) < 0 else min(values)


def agree_prior(prior):
    """``auto``'s estimated line, the same on every rank: None unless every rank has one, else
    the largest intercept and slope (the most memory any rank predicts)."""
    line = None if prior is None else prior[0]
    values = [1, math.ceil(line.intercept), math.ceil(line.slope)] if line is not None else [0, 0, 0]
    rows = dist_sync.exchange(values, "probe estimated prior")
    if not all(row[0] for row in rows):
        return None
    line.intercept = float(max(row[1] for row in rows))
    line.slope = float(max(row[2] for row in rows))
    return prior


def agree_cache_hit(hit):
    """The cached result only if every rank has one; otherwise every rank probes."""
    return hit if dist_sync.agree(hit is not None, "probe cache hit", op="all") else None


def agree_batch(result) -> Any:
    """Set ``result.batch_size`` to the smallest over the ranks (equal already in lockstep)."""
    agreed = dist_sync.agree_min(result.batch_size, "probe result")
    if agreed != result.batch_size:
        result.notes.append(f"batch {result.batch_size} fits this rank; {agreed} is the smallest over the ranks")
        result.batch_size = agreed
    if dist_sync.world_size() > 1:
        # (each rank's own answer: probed on its device, or every rank's cache hit, where no trial ran)
        result.notes.append(f"agreed over {dist_sync.world_size()} ranks (the smallest of the ranks' own answers)")
    return result


def agree_plan(planned) -> Any:
    """Make a :class:`~autobatch.Plan` the same on every rank: the smallest micro-batch over the
    ranks (a safety net: the probes ran in lockstep, and a ``throughput`` pick is made from
    timings the ranks agreed, :mod:`autobatch.dist.timing`). Activation checkpointing on some
    ranks only raises ``RuntimeError`` on every rank. Returns ``planned``, changed in place."""
    from ..planning.accumulation import micro_batch_sizes

    rows = dist_sync.exchange([planned.micro_batch, int(planned.checkpointing)], "plan: micro-batch and checkpointing")
    if len({row[1] for row in rows}) > 1:
        raise RuntimeError("the ranks planned differently (activation checkpointing on some ranks only); pass micro_batch")
    agreed = min(row[0] for row in rows)
    if agreed != planned.micro_batch:
        planned.notes.append(f"micro-batch {planned.micro_batch} planned on this rank; {agreed} is the smallest over the ranks")
        planned.micro_batch = agreed
        planned.micro_batch_sizes = micro_batch_sizes(planned.global_batch, agreed, balanced=planned.balanced)
        planned.accumulation_steps = len(planned.micro_batch_sizes)
    return planned


def agree_arguments(arguments: dict[str, Any]) -> None:
    """One ``ValueError`` on every rank where ``find_max_batch`` was called with other
    search-shaping arguments on other ranks (one sync point, before the first trial). Every rank
    tries the same sizes in the same order only when they match: with another ``max_batch``,
    ``multiple_of`` or ``strategy`` the ranks met at different trials' sync points (a
    ``RankDisagreementError`` naming batch sizes, not the argument), and with another ``margin``
    the rank that verified a reduced size waited in its DDP buckets while the other had finished,
    until the sync deadline. ``memory_limit`` and ``device`` are each rank's own."""
    detail = differing(dist_sync.exchange, "probe: every rank's arguments", arguments, floats=("margin",))
    if detail is not None:
        raise ValueError(
            f"find_max_batch was called with other arguments on other ranks ({detail}); pass the same on every "
            "rank: every rank tries the same batch sizes in the same order and they end on one answer, the largest "
            "that fits the smallest rank (memory_limit and device may differ between ranks)")


def _int(value: int | None) -> int:
    return -1 if value is None else int(value)


def _none(value: int) -> int | None:
    return None if value < 0 else value


class CollectiveProbeAgreement(ProbeAgreement):
    """The probe's agreement under ``torch.distributed``: the functions above, active while a
    process group of more than one rank runs (installed by :mod:`autobatch.dist`)."""

    def active(self) -> bool:
        return dist_sync.is_distributed()

    def local_step(self, fn: Any) -> Any:
        return local_step(fn)

    def exchange(self, values: list[int], label: str) -> list[list[int]]:
        """A sync point (:func:`~autobatch.distributed.exchange`): the planner's timing agrees through it."""
        return dist_sync.exchange(values, label)

    def timed_step(self, step: Any) -> Any:
        """The planner's timing step: ``run(sizes)``, one global step through the runner's
        data-parallel step, failing on every rank together (:mod:`autobatch.dist.timing`)."""
        from .timing import timed_step

        return timed_step(step)

    def left(self, fn: Any, failure: BaseException) -> None:
        if not getattr(fn, "lockstep", False):  # a lockstep step's errors are voted on in the step
            leave(failure, "probe")

    def arguments(self, arguments: dict[str, Any]) -> None:
        agree_arguments(arguments)

    def trial_hook(self):
        return agree_trial

    def capacity(self, capacity: int | None) -> int | None:
        return agree_capacity(capacity)

    def prior(self, prior):
        return agree_prior(prior)

    def cache_hit(self, hit):
        return agree_cache_hit(hit)

    def batch(self, result):
        return agree_batch(result)

    def any_rank(self, value: bool, label: str) -> bool:
        return dist_sync.agree(value, label, op="any")

    def settle_more(self, fn: Any, more: bool) -> bool:
        if not getattr(fn, "lockstep", False):  # trials without collectives: each rank its own
            return more
        return dist_sync.agree(more, "probe: settling trial, another step", op="any")
