"""The runner's plan when it is not given a micro-batch: probed on the data it will train.

A mixin of :class:`~autobatch.Runner`: with ``micro_batch=None`` the runner calls
:func:`~autobatch.plan` on (slices of) the first global batch of its data, agrees the plan
over the ranks, and takes the micro-batch, the activation checkpointing and the grow-back
ceiling from it.
"""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Any, Iterator

from ..planning.accumulation import batch_size_of, cycle_samples
from ..planning.batch_statistics import BATCH_STATISTICS, POWER_ITERATION
from ..errors import NoBatchFitsError
from ..probe.foreach import drop_foreach, foreach_groups
from ..probe.train_step import TrainStep
from .batch_ops import to_device
from .checkpoints.checkpoint_io import rng_state, set_rng_state
from .pacing import FailedDraw, carried, carried_error, every_rank_has

__all__ = ["PlansFromData", "no_batches"]

log = logging.getLogger("autobatch")
_NONE = object()  # the data had no first batch


class PlansFromData:
    """Planning of a :class:`~autobatch.Runner` (which sets the attributes)."""

    def _plan_first(self, batches: Iterator[Any]) -> Iterator[Any]:
        """micro_batch=None: plan it on (slices of) the first global batch of ``batches`` (the
        first epoch's iterator), and return an iterator that yields that batch again first.

        Planning takes its batch from the iterator it then trains, so a one-shot iterable (a
        generator, a stream behind an ``IterableDataset``) loses no sample. Under
        ``torch.distributed`` the ranks first agree that each of them drew one (the sync point
        of every step, :mod:`~autobatch.training.pacing`): a rank whose data is empty is one
        :class:`~autobatch.UnevenDataError` on every rank, before any rank plans. The RNG states are
        put back after planning (:func:`~autobatch.plan` restores model and optimizer), so the
        run draws the same numbers as one given its micro-batch.
        """
        if self.distributed:  # the first draw too, as every step's: one rank without a batch (or whose
            # data raised drawing it) is an error on all
            first = next(carried(batches), _NONE)
            # a batch that cannot be sized (None, empty) raises on every rank before any rank plans
            first = first if first is _NONE or isinstance(first, FailedDraw) else carried_error(lambda: self._sized(first), True)
            failure = first if isinstance(first, FailedDraw) else None
            every_rank_has(self._parallel, first is not _NONE, self.step, self.epoch, self.position, failure=failure)
        else:
            first = next(batches, _NONE)
        if first is _NONE:
            raise ValueError(
                "data yielded no batches: the runner plans its micro-batch on the first global batch; "
                "pass data with at least one batch"
            )
        self._sized(first)  # None or an empty batch is the step's error, naming its place: no probe on 0 samples
        saved = rng_state()
        try:
            self._plan(first)
        finally:
            set_rng_state(saved)
        return itertools.chain([first], batches)

    def _plan(self, first: Any) -> None:
        """Plan the micro-batch with :func:`~autobatch.plan` on slices of ``first``."""
        from ..planning.planner import plan

        available = batch_size_of(first)

        def make_batch(size: int) -> Any:
            # sample i is sample i % available, cut and concatenated: the estimate traces this
            # under fake tensors, which cannot read an index tensor back (take_samples does)
            return to_device(cycle_samples(first, size, available), self.device)

        scaler = self._train_step.grad_scaler
        # the trials step a scaler of their own: the run's keeps its state. A disabled one (GradScaler(enabled=
        # use_fp16)) holds none and changes nothing. A copy, not type(scaler)(device): a subclass whose __init__
        # takes no device raised a bare TypeError, and the older torch.cuda.amp one took the device as init_scale
        if scaler is not None and scaler.is_enabled():
            scaler = copy.deepcopy(scaler)
        options = {"device": self.device, "balanced": self.balanced, **self.plan_options}  # the runner's split, planned
        if self.max_micro_batch is not None and self.max_micro_batch < self.share:  # the ceiling caps the plan too
            options["max_batch"] = min(options.get("max_batch") or self.max_micro_batch, self.max_micro_batch)
        while True:  # twice at most: the second time without torch's foreach step
            step = TrainStep(
                self._train_step.model, self.optimizer, self.loss_fn, make_batch,
                **{**self._train_step.options(), "grad_scaler": scaler},
            )
            try:
                planned = plan(step, global_batch=self.share, **options)
                break
            except NoBatchFitsError as error:
                if not self._plan_without_foreach(step, error):
                    raise
        if self.distributed:  # the probes agreed already; a timed pick may still differ per rank
            self._parallel.agree_plan(planned)
        # plan() warned already where its split meets BatchNorm or spectral norm: the first split step does not again
        self._told_batch_statistics = any(note.startswith(BATCH_STATISTICS) for note in planned.notes)
        self._told_power_iteration = any(note.startswith(POWER_ITERATION) for note in planned.notes)
        self._told_loss_split = planned.accumulation_steps > 1  # plan() checked its loss (LOSS_SPLIT) where it split
        self.micro_batch = self.initial_micro_batch = max(planned.micro_batch, self.min_micro_batch)
        self.balanced = planned.balanced  # the plan's split (multiple_of: full pieces, a smaller last), as it reports
        if planned.micro_batch < self.min_micro_batch:  # the floor wins: out of memory there, the run gives up clearly
            log.warning("plan() chose micro-batch %d, below min_micro_batch=%d: the run starts at %d",
                        planned.micro_batch, self.min_micro_batch, self.micro_batch)
        if planned.checkpointing:
            self.checkpoint_handle = planned.handle
        probed = [r.batch_size for r in planned.probe_results]
        self.growth.ceiling = min(self.share, self.max_micro_batch or max(probed + [self.micro_batch]))  # never above the batch
        self.result.plan = planned.to_dict()
        if self._foreach_planned:  # a resume keeps the switch and says why (resume_checks)
            self.result.plan["foreach_dropped"] = True
        if self.distributed:
            self.result.plan.update(ranks=self._parallel.world_size(), global_batch_all_ranks=self.global_batch, per_rank_batch=self.share)
        log.info("runner planned micro-batch %d (grow-back ceiling %d)", self.micro_batch, self.growth.ceiling)

    _foreach_planned = False  # the plan switched the optimizer's groups to foreach=False

    def _plan_without_foreach(self, step: TrainStep, error: NoBatchFitsError) -> bool:
        """Whether to plan again after ``error`` (no batch fits), with the optimizer's param groups
        switched to ``foreach=False``: its smallest batch ran out of memory inside ``optimizer.step()``
        of torch's foreach step, which no batch size shrinks and the per-tensor step may fit. This is
        what the runner's recovery does for a given micro-batch (:mod:`~.oom.optimizer_phase`), so
        ``micro_batch=None`` trains where a given one would; the same warning, once. :func:`~autobatch.plan`
        called directly leaves the user's optimizer alone (its error names foreach). Under
        ``torch.distributed`` the ranks agree (one rank's OOM there switches every rank's groups)."""
        local = not self._foreach_planned and bool(foreach_groups(self.optimizer)) and error.batch_size in step.optimizer_ooms
        if self.distributed:  # a sync point on every rank that got no plan: the same settings on each
            local = any(row[0] for row in self._parallel.exchange([int(local)], "plan without foreach"))
        if not local:
            return False
        drop_foreach(self.optimizer, f"plan(): every micro-batch down to {error.batch_size} ran out of memory inside "
                                     "optimizer.step()", ", and the micro-batch is planned again")
        self._foreach_planned = True
        return True


def no_batches(size: int) -> Any:
    """The ``make_batch`` of the runner's ``TrainStep``, which takes its batches from the data: never
    called for a batch. A function, not a method: the ``TrainStep`` the runner holds would hold the
    runner (a cycle, :mod:`~autobatch.training.weak_calls`); and as a method it was shadowed by
    ``Resumable._no_batches`` (the error for data that yields nothing), which returned an error
    where this raises one."""
    raise RuntimeError("the runner's TrainStep takes its batches from the data, not make_batch")
