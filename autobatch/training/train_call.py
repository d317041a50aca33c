"""``autobatch.train``: build a :class:`~autobatch.Runner` from plain keyword options and fit it.

The one call a config or a CLI needs, apart from the runner's module (the step loop) so that its
keyword check has a home: ``train(**options)`` hands the options to ``Runner``, and a keyword
neither takes (``max_epochs`` from a Lightning config, ``grow_afer``) is one ``TypeError`` from
``train()`` naming the one meant (``epochs``, ``grow_after``), not the Runner's list of its own
keywords without ``train()``'s ``epochs``, ``steps``, ``resume`` and ``on_step_end``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch

from .. import checks
from .inputs import FIT_ALIASES, RUNNER_ALIASES, RUNNER_PLAN_KEYWORDS
from .run_result import RunResult
from .runner import LossFn, Runner

__all__ = ["train"]


@checks.keywords({**RUNNER_ALIASES, **FIT_ALIASES}, inside=RUNNER_PLAN_KEYWORDS, forwards=Runner)
def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    data: Iterable[Any],
    *,
    epochs: int | None = None,
    steps: int | None = None,
    resume: str | os.PathLike | None = None,
    on_step_end: Callable[[dict[str, Any]], None] | None = None,
    global_batch: int,
    **options: Any,
) -> RunResult:
    """Build a :class:`~autobatch.Runner` from plain keyword ``options`` and fit it: the CLI's entry point.

    ``options`` are :class:`~autobatch.Runner`'s keyword arguments (``global_batch`` is required;
    every other has the Runner's default), so a config section maps onto it directly:
    ``train(model, opt, loss_fn, loader, epochs=3, **cfg.runner)``. ``epochs``, ``steps``, ``resume``
    and ``on_step_end`` go to :meth:`~autobatch.Runner.fit` (neither ``epochs`` nor ``steps``: one
    epoch). Every option is checked when the runner is made, before any training; a keyword
    neither takes is one ``TypeError`` naming the closest (``max_epochs``: ``epochs``).
    """
    # global_batch is train()'s own required keyword, so that leaving it out is said of train(), the call
    # made, not of "Runner.__init__()"
    runner = Runner(model, optimizer, loss_fn, global_batch=global_batch, **options)
    return runner.fit(data, epochs=epochs, steps=steps, resume=resume, on_step_end=on_step_end)
