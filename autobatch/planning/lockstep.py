"""Timing a candidate plan in lockstep with the other ranks of a job (:mod:`autobatch.planning.throughput`).

Under ``torch.distributed`` every rank must time the same candidates for the same number of steps
and enter the same collectives: :class:`Lockstep` runs each global step as the runner's own
data-parallel step and agrees, at named sync points, whether a candidate is pruned and its outcome.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from ..probe import ranks

if TYPE_CHECKING:
    from .throughput import Candidate

__all__ = ["Lockstep"]


class Lockstep:
    """Timing in lockstep with the other ranks of a job: ``run(sizes)`` is one global step of
    the runner's data-parallel step (it fails on every rank together, so no rank waits alone in
    a collective), ``exchange`` a sync point. Both come from the probe's agreement, which
    :mod:`autobatch.dist` installs (planning never imports the distributed layer)."""

    def __init__(self, agreement: Any, step: Any) -> None:
        self.exchange = agreement.exchange
        self.run = agreement.timed_step(step)

    @classmethod
    def of(cls, step: Any) -> "Lockstep | None":
        agreement = ranks.current()
        return cls(agreement, step) if agreement.active() else None

    def slowest(self, failure: str | None, seconds: float, candidate: Candidate, index: int = 0) -> float | None:
        """The largest of the ranks' timed step ``index`` (0: the first), so that whether it prunes is
        decided alike; None where some rank failed before it (every rank then goes on to the outcome)."""
        rows = self.exchange([int(failure is not None), _bits(seconds)],
                             f"plan timing: candidate {candidate.key}, timed step {index + 1}")
        return None if any(row[0] for row in rows) else max(_seconds(row[1]) for row in rows)

    def outcome(self, candidate: Candidate, failure: str | None, times: list[float], retries: int | None,
                timed_steps: int) -> tuple[str | None, list[float], int | None]:
        """Every rank's (failure, step times, allocator retries) agreed: failed where any rank
        failed; each step's time the largest over the ranks; the retries the most, or None
        where some rank does not count them."""
        padded = [_bits(t) for t in times] + [0] * (timed_steps - len(times))
        rows = self.exchange([int(failure is not None), len(times), -1 if retries is None else retries, *padded],
                             f"plan timing: candidate {candidate.key}, outcome")
        failed = [rank for rank, row in enumerate(rows) if row[0]]
        if failed:
            return failure or f"out of memory on rank {', '.join(map(str, failed))}", [], None
        count = min(row[1] for row in rows)
        agreed = [max(_seconds(row[3 + i]) for row in rows) for i in range(count)]
        return None, agreed, None if min(row[2] for row in rows) < 0 else max(row[2] for row in rows)


def _bits(seconds: float) -> int:
    """A time as the int64 of its float64's bits (exact; ``-0.0`` as ``0.0``)."""
    return struct.unpack("<q", struct.pack("<d", float(seconds) + 0.0))[0]


def _seconds(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]
