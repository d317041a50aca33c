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
"""

from __future__ import annotations

from typing import Any

__all__ = ["GrowBack"]


class GrowBack:
    """The grow-back state machine; the runner calls :meth:`propose`, then one of
    :meth:`on_oom` (any number of times) and :meth:`on_step_done` per global step."""

    def __init__(self, grow_after: int | None, ceiling: int) -> None:
        if grow_after is not None and (isinstance(grow_after, bool) or not isinstance(grow_after, int) or grow_after < 0):
            raise ValueError(f"grow_after must be an integer >= 0 or None (off), got {grow_after!r}")
        self.grow_after = grow_after or None
        self.ceiling = ceiling
        self.wait = self.grow_after or 0
        self.streak = 0
        self.previous: int | None = None  # the size that worked, while a larger one is tried
        self._oom_this_step = False

    @property
    def enabled(self) -> bool:
        return self.grow_after is not None

    @property
    def trying(self) -> bool:
        return self.previous is not None

    def propose(self, micro_batch: int) -> int:
        """The micro-batch to start the next step with (larger than ``micro_batch`` to grow)."""
        self._oom_this_step = False
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
        self.wait *= 2
        return back

    def on_step_done(self) -> None:
        """The step finished. A grow that held restarts the count towards the next one."""
        held = self.previous is not None and not self._oom_this_step
        self.previous = None
        self.streak = 0 if (self._oom_this_step or held) else self.streak + 1

    def state_dict(self) -> dict[str, Any]:
        return {"wait": self.wait, "streak": self.streak, "ceiling": self.ceiling}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait, self.streak, self.ceiling = state["wait"], state["streak"], state["ceiling"]
