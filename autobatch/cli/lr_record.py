"""The learning rate of each optimizer step, for ``metrics.jsonl``'s ``lr`` field.

The runner steps a schedule *after* each optimizer step, so by the time ``on_step_end`` runs the
optimizer's param groups already hold the next step's learning rate: reading them there would
shift a plotted schedule by one step (and never show the first step's warm-up value).
:class:`StepLearningRates` reads them in an optimizer step pre-hook instead, i.e. at the moment
the update is applied. A step the ``GradScaler`` skipped (no ``optimizer.step()`` call) reports
the rate it would have used: the one the groups held when the previous step's line was written,
since only the schedule changes it and the schedule steps after the update.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StepLearningRates", "group_lrs"]


def group_lrs(optimizer: torch.optim.Optimizer) -> float | list[float]:
    """The learning rate of ``optimizer``: the first param group's, or one per group when they
    differ (a model with a lower rate for its embeddings, say). A tensor ``lr`` is given as a float."""
    rates = [float(group["lr"]) for group in optimizer.param_groups]
    return rates[0] if len(set(rates)) <= 1 else rates


class StepLearningRates:
    """Records the learning rate each optimizer step applies (a step pre-hook on ``optimizer``).

    ``taken()`` gives the rate of the step just ended and readies the fallback for the next one;
    leaving the ``with`` block removes the hook (the optimizer outlives the run in the caller's hands)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._current: float | list[float] | None = None
        self._handle = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._current = group_lrs(optimizer)  # a replay after an OOM applies the same rate again

    def taken(self) -> float | list[float]:
        """The rate the step just ended was applied at (see the module docstring)."""
        rate = self._current if self._current is not None else group_lrs(self.optimizer)
        self._current = group_lrs(self.optimizer)  # the schedule has stepped: the next step's rate
        return rate

    def pending(self) -> float | list[float]:
        """The rate of a step applied but not yet ``taken()`` (a run stopped between the two)."""
        return self._current if self._current is not None else group_lrs(self.optimizer)

    def __enter__(self) -> "StepLearningRates":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
