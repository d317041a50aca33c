"""The runner's own split, said once where it is not exact: BatchNorm, spectral norm.

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
"""

from __future__ import annotations

import logging

import torch

from ..planning.batch_statistics import power_iteration_layers
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
    its first step trained in several pieces, :meth:`_tell_split` warns for what makes them inexact."""

    _told_batch_statistics = False  # warned (or the plan did) that BatchNorm normalises each micro-batch on its own
    _told_power_iteration = False  # warned (or the plan did) that spectral norm iterates once per micro-batch

    def _tell_split(self) -> None:
        """Once the step trained in more than one piece: warn for BatchNorm and spectral norm, each once."""
        if self._told_batch_statistics and self._told_power_iteration:
            return
        sizes = self._piece_sizes()
        if len(sizes) < 2:
            return
        if not self._told_batch_statistics:
            warn_batch_statistics(self._train_step.model, sizes)
            self._told_batch_statistics = True
        if not self._told_power_iteration:
            warn_power_iteration(self._train_step.model, sizes)
            self._told_power_iteration = True
