"""Grow-back: after a run of OOM-free steps, try a larger micro-batch again, without oscillating.

An OOM is often transient (one long sequence, a fragmented cache, a neighbour's burst), so a
micro-batch halved at step 40,000 should not stay halved for the rest of the run. The policy:

* after ``grow_after`` consecutive global steps without an OOM, the next step tries double
  the micro-batch, bounded by ``ceiling`` (the probe's maximum, or the micro-batch the run
  started with) and the global batch;
* if that step OOMs at the larger size, the runner goes back to the size that worked and
  the wait before the next try doubles (exponential back-off); a grow that holds keeps it.

So over ``T`` steps at most ``log2(T / grow_after) + 1`` grow attempts can fail, each
costing one replayed step: the micro-batch never oscillates. ``grow_after=None`` (or 0)
turns grow-back off.

After a *measured* recovery (the runner's memory line sized the smaller micro-batch, see
:mod:`autobatch.training.oom.step_memory`) the squeeze may be transient: a neighbour's burst, a
tensor held for a few steps. Then the wait is one step, not ``grow_after``: as soon as the line
says, from what is resident now, that a larger size fits again, the next step tries the
largest such size up to the one the run had before the squeeze. The size before the squeeze
waits for no step at all: after a try part of the way back held (the squeeze still there), the
step after the squeeze ended trained at the partial size too, since the held try restarted the
count (30 % taken after step 3, half given back after step 5, the rest after step 6: the 7th
step trained at the partial size, now at the size before the squeeze). A
try that fails doubles that short wait too, and from then on the return waits for it as well, so
this path cannot oscillate either. Where the recovery was the batch's own (it
needed more than the line says for its size: an outlier batch, see
:mod:`autobatch.training.oom.step_memory`), the next step tries at once, not after that wait: the
next ordinary batch trains at the size before the outlier (after a 128-token batch in a run of
16-token ones at 32, the next batch trained at 5; now at 32); a try that fails is a quick try
that failed (the wait doubles).

With ``Runner(multiple_of=N)`` every size it proposes is a multiple of N: the ceiling is rounded
down to one (the batch per rank, its upper bound, is one), doubling a multiple is one, and a
measured target is rounded down (:mod:`autobatch.training.multiples`).

A resumed run keeps what its checkpoint's run learned from OOMs (the back-off doublings, the
streak, a measured squeeze) and takes its settings (``grow_after``, the ceiling when given)
from its own constructor, never from the checkpoint: see :meth:`GrowBack.load_state_dict`.
"""

from __future__ import annotations

from typing import Any

from ... import checks

__all__ = ["GrowBack"]


class GrowBack:
    """The grow-back state machine; the runner calls :meth:`propose`, then one of
    :meth:`on_oom` (any number of times) and :meth:`on_step_done` per global step."""

    def __init__(self, grow_after: int | None, ceiling: int, *, configured: bool = True, multiple_of: int = 1) -> None:
        grow_after = checks.count("grow_after", grow_after, allow_none=True, meaning=" (0 or None: off)")
        self.grow_after = grow_after or None
        self.multiple_of = multiple_of  # every size proposed is a multiple of it
        self.ceiling = ceiling
        self.configured = configured  # the ceiling is the user's (max_micro_batch, micro_batch), not a placeholder to plan
        self.wait = self.grow_after or 0
        self.streak = 0
        self.previous: int | None = None  # the size that worked, while a larger one is tried
        self.squeezed_from: int | None = None  # the micro-batch before a measured recovery
        self.quick_wait = 1  # steps before a measured grow-back try (doubles when one fails)
        self._quick = False
        self._oom_this_step = False
        self._soon = False  # the last step's recovery was its batch's own: the next one tries at once

    @property
    def ceiling(self) -> int:
        """The largest micro-batch grow-back tries: a multiple of ``multiple_of`` (set rounded down, at least it)."""
        return self._ceiling

    @ceiling.setter
    def ceiling(self, value: int) -> None:
        self._ceiling = max(self.multiple_of, value // self.multiple_of * self.multiple_of)

    @property
    def enabled(self) -> bool:
        return self.grow_after is not None

    @property
    def trying(self) -> bool:
        return self.previous is not None

    def squeezed(self, before: int) -> None:
        """A measured recovery took the micro-batch down from ``before``."""
        self.squeezed_from = max(self.squeezed_from or 0, before)

    def propose(self, micro_batch: int, fits: int | None = None) -> int:
        """The micro-batch to start the next step with (larger than ``micro_batch`` to grow).

        ``fits``: the largest micro-batch the runner's memory line says fits now (None:
        unknown); used only to grow back after a measured recovery."""
        self._oom_this_step = False
        self._quick = False
        soon, self._soon = self._soon, False
        if self.squeezed_from is not None and micro_batch >= min(self.squeezed_from, self.ceiling):
            self.squeezed_from = None  # back where the squeeze found it
        if self.enabled and self.squeezed_from is not None and fits is not None:
            full = min(self.squeezed_from, self.ceiling) // self.multiple_of * self.multiple_of
            target = min(fits // self.multiple_of * self.multiple_of, full)
            # all the way back waits for no streak until such a try failed; part of the way, one step
            ready = soon or self.streak >= self.quick_wait or (target >= full and self.quick_wait == 1)
            if target > micro_batch and ready:
                self.previous, self._quick = micro_batch, True
                return target
        if not self.enabled or self.streak < self.wait or micro_batch >= self.ceiling:
            return micro_batch
        self.previous = micro_batch
        return min(2 * micro_batch, self.ceiling)

    def on_oom(self) -> int | None:
        """An OOM in this step. Returns the size to go back to when a grow try failed."""
        self._oom_this_step = True
        self.streak = 0
        if self.previous is None:
            return None
        back, self.previous = self.previous, None
        if self._quick:
            self.quick_wait *= 2
        else:
            self.wait *= 2
        return back

    def cancel(self) -> int | None:
        """The step was abandoned (an interrupt, an error): a grow try in it did not happen.
        Returns the size to go back to (None: no try was running); the wait is unchanged."""
        back, self.previous, self._quick = self.previous, None, False
        return back

    def on_step_done(self, outlier: bool = False) -> None:
        """The step finished. A grow that held restarts the count towards the next one.
        ``outlier``: its recovery was its batch's own (the next step tries to grow back at once)."""
        self._soon = outlier and self._oom_this_step and self.squeezed_from is not None
        held = self.previous is not None and not self._oom_this_step
        self.previous = None
        self.streak = 0 if (self._oom_this_step or held) else self.streak + 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait": self.wait, "streak": self.streak, "ceiling": self.ceiling, "grow_after": self.grow_after,
            "squeezed_from": self.squeezed_from, "quick_wait": self.quick_wait,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], limit: int | None = None) -> None:
        """Carry over what a checkpoint's run learned; this object's settings win.

        Learned, and kept: the streak of OOM-free steps, the back-off (the number of failed tries
        that doubled the wait, applied to this ``grow_after``), a measured squeeze and its short
        wait. Settings, never taken from the checkpoint: ``grow_after`` (a checkpoint of a run with
        grow-back off held ``wait=0``, which made every step try to grow) and a configured ceiling
        (``max_micro_batch``). Only a ceiling left to planning (a resume does not plan) is the
        checkpoint's: its run's probe maximum, at most ``limit`` (this run's batch per rank).
        """
        self.streak = state["streak"]
        self.squeezed_from = state.get("squeezed_from")  # absent in checkpoints of older versions
        self.quick_wait = state.get("quick_wait", 1)
        if not self.configured:
            self.ceiling = state["ceiling"] if limit is None else min(state["ceiling"], limit)
        self.wait = (self.grow_after or 0) * self._doublings(state["wait"], state.get("grow_after"))

    def _doublings(self, wait: int, grow_after: int | None) -> int:
        """``2**k``, k the failed grow tries behind the checkpoint's ``wait`` (1: none, or unknown).
        A checkpoint of an older version holds no ``grow_after``: its wait counts as this
        ``grow_after``'s when it is a power-of-two multiple of it (the same setting), else as none."""
        base = grow_after if grow_after is not None else self.grow_after
        if not base or not wait or wait % base:
            return 1
        factor = wait // base
        return factor if factor & (factor - 1) == 0 else 1
