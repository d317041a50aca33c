"""Fault injection: raise a real ``torch.OutOfMemoryError`` at chosen (step, phase) points.

Recovery code that never runs is recovery code that does not work. A :class:`FaultInjector`
handed to the :class:`~autobatch.Runner` (``Runner(..., faults=...)`` or
:func:`inject_oom`) is consulted at every phase boundary of every global step and raises the
same exception the CUDA caching allocator raises, so the runner's real recovery path runs:
on a CPU in the tests, or on your own GPU set-up to check it survives before a 3 a.m. OOM
does it for you.

Phases, in the order a global step meets them:

* ``"transfer"``: before a micro-batch is moved to the device;
* ``"forward"``: before a micro-batch's loss is computed;
* ``"backward"``: before its backward;
* ``"optimizer"``: before ``optimizer.step()``.

Steps are the runner's global step index, counting from 0 over the whole run (a resumed run
continues the count). ``times=1`` fails the first arrival at each point only (the replay
then succeeds); ``times=k`` the first ``k`` arrivals (the micro-batch halves ``k`` times; at ``"optimizer"`` it
is replayed at the same micro-batch, then with ``foreach=False`` where the optimizer ran its foreach
step, and the next arrival gives the step up);
``times=None`` every arrival (the step can never succeed: the runner gives up, or falls
back to activation checkpointing first).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from ... import checks
from ..phases import PHASES

__all__ = ["PHASES", "FaultInjector", "inject_oom"]

log = logging.getLogger("autobatch")

#: other names users give the points and the count (``inject_oom(runner, at_step=3)`` was Python's
#: bare "unexpected keyword argument"): the did-you-mean names ``at``, which takes (step, phase) pairs
FAULT_ALIASES = {"at_step": "at", "step": "at", "steps": "at", "phase": "at", "points": "at", "where": "at",
                 "count": "times", "repeat": "times", "n": "times"}


class FaultInjector:
    """Raise ``torch.OutOfMemoryError`` at the ``(step, phase)`` points in ``at``.

    ``at`` is one ``(step, phase)`` pair or an iterable of them. ``fired`` lists the points
    that raised, in order, one entry per raise.
    """

    @checks.keywords(FAULT_ALIASES)
    def __init__(self, at: tuple[int, str] | Iterable[tuple[int, str]], *, times: int | None = 1) -> None:
        pair = isinstance(at, (tuple, list)) and len(at) == 2 and isinstance(at[1], str)  # (3, "forward"), [3, "forward"]
        points = [tuple(at)] if pair else list(at) if isinstance(at, Iterable) and not isinstance(at, (str, bytes, torch.Tensor)) else None
        if points is None or not all(isinstance(point, (tuple, list)) and len(point) == 2 for point in points):
            raise TypeError(f"at must be one (step, phase) pair or a list of them, got {checks.shown(at)}; e.g. "
                            f"at=(3, 'forward') or at=[(0, 'forward'), (5, 'optimizer')] (phases: {', '.join(PHASES)})")
        points = [(checks.integer(step), phase) if checks.integer(step) is not None else (step, phase) for step, phase in points]
        for step, phase in points:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"fault step must be an integer >= 0, got {step!r}")
            if phase not in PHASES:
                raise ValueError(f"fault phase must be one of {', '.join(PHASES)}; got {phase!r}")
        times = checks.count("times", times, low=1, allow_none=True, meaning=" (None: every time)")
        self.points = {(step, phase) for step, phase in points}
        self.times = times
        self.fired: list[tuple[int, str]] = []
        self._count: dict[tuple[int, str], int] = {}

    def __call__(self, step: int, phase: str) -> None:
        """Raise if ``(step, phase)`` is a point that still has raises left."""
        point = (step, phase)
        if point not in self.points:
            return
        done = self._count.get(point, 0)
        if self.times is not None and done >= self.times:
            return
        self._count[point] = done + 1
        self.fired.append(point)
        log.debug("injecting an out-of-memory error at step %d, phase %s", step, phase)
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autobatch at step {step}, phase {phase})")

    def __repr__(self) -> str:
        return f"FaultInjector(at={sorted(self.points)}, times={self.times}, fired={len(self.fired)})"


@checks.keywords(FAULT_ALIASES)
def inject_oom(runner, at: tuple[int, str] | Iterable[tuple[int, str]], *, times: int | None = 1) -> FaultInjector:
    """Make ``runner`` (a :class:`~autobatch.Runner`) hit real OOMs at ``at``; returns the injector.

    >>> injector = inject_oom(runner, at=[(0, "forward"), (41, "optimizer")], times=2)
    """
    from ..runner import Runner  # here: the runner imports this module

    if not isinstance(runner, Runner):  # a model took .faults without a word, a None failed as AttributeError
        raise TypeError(f"runner must be an autobatch.Runner, got {type(runner).__name__} {checks.shown(runner)}; pass "
                        "the Runner that trains, or give the injector to it: Runner(..., faults=FaultInjector(at))")
    injector = FaultInjector(at, times=times)
    runner.faults = injector
    return injector
