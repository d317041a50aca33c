"""The runner's plan when it is not given a micro-batch: probed on the data it will train.

A mixin of :class:`~autobatch.Runner`: with ``micro_batch=None`` the runner calls
:func:`~autobatch.plan` on (slices of) the first global batch of its data, agrees the plan
over the ranks, and takes the micro-batch, the activation checkpointing and the grow-back
ceiling from it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable

import torch

from ..planning.accumulation import batch_size_of
from ..probe.train_step import TrainStep
from .batch_ops import map_tensors, to_device
from .checkpoint_io import rng_state

__all__ = ["PlansFromData"]

log = logging.getLogger("autobatch")

_NOTHING = object()


class PlansFromData:
    """Planning of a :class:`~autobatch.Runner` (which sets the attributes)."""

    def _plan(self, data: Iterable[Any]) -> None:
        """micro_batch=None: plan it on (slices of) the first global batch.

        The first batch is then trained first (see below); :func:`~autobatch.plan` restores
        the model and optimizer.
        """
        from ..planning.planner import plan

        # The first batch is taken from the iterator the first epoch then trains on, so a
        # one-shot iterable (a generator, an IterableDataset loader) loses no sample; the epoch's
        # random state is the one from before that iterator was made (exact resume).
        epoch_rng = rng_state()
        batches = iter(data)
        first = next(batches, _NOTHING)
        if first is _NOTHING:
            raise ValueError(
                "data yielded no batches, so there is nothing to plan the micro-batch on; pass data with "
                "at least one global batch (or give micro_batch)"
            )
        self._planned_epoch = (epoch_rng, itertools.chain([first], batches))
        available = batch_size_of(first)

        def make_batch(size: int) -> Any:
            index = torch.arange(size) % available
            return to_device(map_tensors(first, lambda t: t.index_select(0, index.to(t.device))), self.device)

        step = TrainStep(self._train_step.model, self.optimizer, self.loss_fn, make_batch, autocast_dtype=self._train_step.autocast_dtype)
        options = {"device": self.device, **self.plan_options}
        planned = plan(step, global_batch=self.share, **options)
        if self.distributed:  # the probes agreed already; a timed pick may still differ per rank
            self._parallel.agree_plan(planned)
        self.micro_batch = self.initial_micro_batch = planned.micro_batch
        if planned.checkpointing:
            self.checkpoint_handle = planned.handle
        probed = [r.batch_size for r in planned.probe_results]
        self.growth.ceiling = self.max_micro_batch or min(self.share, max(probed + [planned.micro_batch]))
        self.result.plan = planned.to_dict()
        if self.distributed:
            self.result.plan.update(ranks=self._parallel.world_size(), global_batch_all_ranks=self.global_batch, per_rank_batch=self.share)
        log.info("runner planned micro-batch %d (grow-back ceiling %d)", self.micro_batch, self.growth.ceiling)

    @staticmethod
    def _no_batches(size: int) -> Any:
        raise RuntimeError("the runner's TrainStep takes its batches from the data, not make_batch")
