"""The runner's own split, said once where it is not exact: BatchNorm, spectral norm, the loss.

Gradient accumulation trains one global batch's gradient in micro-batches exactly, except where
the model's forward depends on which samples it sees together or on how many forwards a step
runs: BatchNorm in training mode normalises each piece with its own statistics
(:func:`~autobatch.training.inputs.warn_batch_statistics`), and spectral norm in training mode
runs a power iteration in every forward, so each piece divides the weight by another estimate
of its largest singular value (:mod:`autobatch.planning.batch_statistics`). ``plan()`` notes
both where its split meets them; a :class:`~autobatch.Runner` that splits the batch itself
(``micro_batch < global_batch``, or a replay after an OOM) warns once for each, at its first
step trained in several pieces. A runner that planned is told by the plan's notes already
(:mod:`autobatch.training.autoplan` sets the flags), so it does not warn twice.

The runner weights each micro-batch's loss by its share of the samples, which trains one batch's
gradient for a loss that is a mean over samples only. For another (``reduction='sum'``, class
weights, a token mean over padded sequences) a given split trains a steady update, but the first
step cut otherwise than the run's first (an OOM replay's smaller pieces, grow-back's larger ones)
silently changes it: a sum is halved by a replay that halves the micro-batch. That step, once,
reads the ``loss_fn`` without calling it (:func:`~autobatch.planning.loss_reduction.seen_reduction`:
its loss modules and ``reduction="sum"`` keywords; no call, for a ``loss_fn`` may count its calls,
log or step a schedule) and warns where it shows a reduction that is no mean. Nothing is read
before (a run that never changes its split pays nothing), nor under ``torch.distributed``; a
runner whose plan split its batches was told by ``plan()``'s numeric check (autoplan sets the flag).
"""

from __future__ import annotations

import logging

import torch

from ..planning.batch_statistics import power_iteration_layers
from ..planning.loss_reduction import seen_reduction
from ..planning.split_checks import LOSS_KINDS, LOSS_SPLIT, MEAN_LOSS
from .carried_state import warn_carried_state
from .inputs import _sizes_text, warn_batch_statistics

log = logging.getLogger("autobatch")

__all__ = ["TellsSplit", "warn_power_iteration"]


def warn_power_iteration(model: torch.nn.Module, sizes: list[int]) -> bool:
    """Warn, once a step trains in several micro-batches (``sizes``), where ``model`` has
    spectral-norm layers in training mode: each piece's forward runs a power iteration, so the
    step's accumulated gradient is not one batch's. Returns whether it warned."""
    shown = power_iteration_layers(model)
    if shown is None:
        return False
    log.warning(
        "Spectral norm in training mode (%s) runs a power iteration in every forward: this step's micro-batches "
        "of %s divide each weight by successive estimates of its largest singular value where one batch of %d "
        "would use one, so their accumulated gradient differs slightly from that batch's (and the estimate "
        "advances faster), as an OOM recovery's smaller ones do again. Where that matters: more memory (one "
        "piece per step), or n_power_iterations large enough that the estimate has converged",
        shown, _sizes_text(sizes), sum(sizes),
    )
    return True


class TellsSplit:
    """A mixin of the runner's recovery (:class:`~autobatch.training.oom.recovery.OomRecovery`): at
    its first step trained in several pieces, :meth:`_tell_split` warns for what makes them inexact;
    at its first attempt cut otherwise than the run's first, :meth:`_check_loss_split` checks the loss."""

    _told_batch_statistics = False  # warned (or the plan did) that BatchNorm normalises each micro-batch on its own
    _told_power_iteration = False  # warned (or the plan did) that spectral norm iterates once per micro-batch
    _told_loss_split = False  # checked (or the plan did) whether the loss is a mean over samples
    _first_split: tuple[int, list[int]] | None = None  # (micro-batch, full batch's pieces) of the run's first attempt
    _told_carried_state = False  # warned that a module keeps a tensor sized by the micro-batch (carried_state)
    _trained_sizes: frozenset[int] = frozenset()  # the micro-batch pieces' sizes of the steps trained (carried_state)

    def _tell_split(self) -> None:
        """Once the step trained in more than one piece: warn for BatchNorm, spectral norm and state a
        module carries between forwards (:mod:`~autobatch.training.carried_state`), each once."""
        sizes = self._piece_sizes()
        self._trained_sizes = self._trained_sizes | set(sizes)  # an error at another size is checked against them
        if len(sizes) < 2:
            return
        if not self._told_carried_state:  # not told by a plan: its trials' state is put back after them
            self._told_carried_state = warn_carried_state(self._train_step.model, sizes, self.share) or True
        if self._told_batch_statistics and self._told_power_iteration:
            return
        if not self._told_batch_statistics:
            warn_batch_statistics(self._train_step.model, sizes)
            self._told_batch_statistics = True
        if not self._told_power_iteration:
            warn_power_iteration(self._train_step.model, sizes)
            self._told_power_iteration = True

    def _check_loss_split(self) -> None:
        """At the first attempt whose split of a full batch differs from the run's first one's: warn
        once where ``loss_fn`` shows a reduction that is no mean over samples (see the module docstring)."""
        if self._told_loss_split or self.distributed:
            return
        if self._first_split is None:
            self._first_split = (self.micro_batch, self._piece_sizes(self.share))
        before, pieces = self._first_split
        now = [] if self.micro_batch == before else self._piece_sizes(self.share)
        if not now or now == pieces:
            return
        self._told_loss_split = True
        seen = seen_reduction(self.loss_fn)
        if seen is None:
            return
        why = "an OOM recovery's smaller ones" if max(now) < max(pieces) else "grow-back's larger ones"
        log.warning(
            "%s: %s. The runner weights each micro-batch's loss by its share of the batch's samples, which trains one "
            "batch's gradient for a mean over samples only, so from step %d on, with batches of %d cut into micro-batches "
            "of %s (%s) where the run trained micro-batches of %s before, its updates differ from the earlier steps' "
            "(%s: a sum is scaled by the split). Where that matters, use %s",
            LOSS_SPLIT, seen, self.step, self.share, _sizes_text(now), why, _sizes_text(pieces), LOSS_KINDS, MEAN_LOSS,
        )
