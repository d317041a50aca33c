"""The planner's accumulated probe for a step whose gradients are sparse: every micro-batch of the plan.

:class:`~autobatch.planning.accumulation.AccumulatingStep` probes an accumulated plan with two
micro-batches: a dense gradient is as large after two as after twenty, so the second one's forward
and backward beside the first's gradients is the plan's peak. A sparse gradient (a ``sparse=True``
embedding's, what ``SparseAdam`` steps on) is not: torch adds sparse gradients without coalescing
them, so the accumulated gradient holds a row per token of every micro-batch so far and grows with
each one. On the CPU's simulated device (8 MiB) a 20,000 x 32 ``sparse=True`` embedding under
``SparseAdam`` planned global batch 2000 as 118 x 17, whose first step's accumulated gradient held
32,084 rows and ran out of memory in ``optimizer.step()``. :class:`PlanAccumulatingStep` runs the
plan's whole step at each micro-batch size tried (``ceil(global_batch / size)`` micro-batches of at
most it, summing to the global batch), so the answer's trial is a step the plan trains.
"""

from __future__ import annotations

from ..probe.content_peaks import trained_parts
from ..probe.tracing.trace_failures import sparse_embeddings, sparse_gradients
from ..probe.train_step import TrainStep
from .accumulation import AccumulatingStep, LazyMicroBatches, accumulated_step, micro_batch_sizes

__all__ = ["accumulating_step", "PlanAccumulatingStep", "has_sparse_gradients"]


def has_sparse_gradients(step: TrainStep) -> bool:
    """Whether ``step`` trains sparse gradients: a ``sparse=True`` embedding in its model or its loss
    module, or a ``SparseAdam`` optimizer (:func:`~autobatch.probe.content_peaks.trained_parts`)."""
    modules, optimizers = trained_parts(step, None)
    return any(True for _, module in modules for _ in sparse_embeddings(module)) or \
        sparse_gradients(None, optimizers) is not None


class PlanAccumulatingStep(AccumulatingStep):
    """``step`` as a plan of ``global_batch`` with micro-batches of the size asked for trains it: one
    optimizer step over all ``ceil(global_batch / size)`` of them (the last one smaller), built one at
    a time. For sparse gradients, whose accumulated size grows with every micro-batch."""

    def __init__(self, step: TrainStep, global_batch: int) -> None:
        super().__init__(step)
        self.global_batch = global_batch

    def __call__(self, batch_size: int) -> None:
        sizes = micro_batch_sizes(self.global_batch, batch_size)
        accumulated_step(self, LazyMicroBatches(sizes, self.make_batch), global_batch=self.global_batch, lazy=True)


def accumulating_step(step: TrainStep, global_batch: int) -> AccumulatingStep:
    """The accumulated step the planner probes: two micro-batches (:class:`AccumulatingStep`), or, where the
    gradients are sparse, every micro-batch of the plan (:class:`PlanAccumulatingStep`)."""
    return PlanAccumulatingStep(step, global_batch) if has_sparse_gradients(step) else AccumulatingStep(step)
