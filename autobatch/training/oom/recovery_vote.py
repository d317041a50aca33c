"""The ranks' vote on an out-of-memory recovery: one sync point, the same decision on every rank.

Under ``torch.distributed`` an OOM on any rank brings every rank into the step's replay (the
step's contract: the others get :class:`~autobatch.errors.PeerOutOfMemoryError`), and then each
must take the same branch of the recovery, since each branch runs other collectives next. The
micro-batch is per rank (``Runner(micro_batch=)``, and grow-back's ceiling where
``max_micro_batch`` is unset), so the branch a rank would pick alone could differ: a rank at its
floor gave up (``StepOutOfMemoryError``) or turned on checkpointing while a peer proposed a size
at the recovery's sync point and waited there until the sync deadline; and after an OOM that no
rank measured each rank halved its own micro-batch, so the ranks stayed apart until the smaller
one reached its floor first. Now every distributed recovery goes through one exchange (``runner
step N: next micro-batch``) of a row per rank, ``[proposal, measured, at floor, stops, grow-back
try]``, and every rank reads the same rows:

* a rank at its floor (``min_micro_batch``) with no fallback left (``checkpointing_fallback``
  off, or its model checkpointed already) votes from tenacity's stop and gives up; every other
  rank gives up with it (``StepOutOfMemoryError`` naming that rank), the step undone everywhere;
* else a rank at its floor turns the fallback on everywhere (activation checkpointing);
* the micro-batch is the smallest proposal (a multiple of ``multiple_of``, at least
  ``min_micro_batch``), the same on every rank: a rank that ran out proposes its measured size,
  or half of its micro-batch when its figures do not explain the failure; a rank that did not
  proposes its own line's size, or its micro-batch; a failed grow-back try proposes the size
  before it; a rank at its floor proposes its micro-batch.
* an OOM inside ``optimizer.step()`` (the phase is the same on every rank: all of them entered
  it before the vote that raised it) proposes the micro-batch as it is (a failed grow-back try
  the size before it): the step is replayed at the same size once, and a second such OOM ends
  it on every rank alike, with no vote (:mod:`~autobatch.training.oom.optimizer_phase`).

Steps without an OOM run no sync point for this; an OOM runs this one (it ran one before, except
at the floor or after a grow-back try). One process: nothing here runs.
"""

from __future__ import annotations

from ...errors import PeerOutOfMemoryError
from ..multiples import round_down

__all__ = ["VotesRecovery", "PROPOSAL", "MEASURED", "FLOOR", "STOPS", "BACK"]

PROPOSAL, MEASURED, FLOOR, STOPS, BACK = range(5)  # the columns of a rank's row


class VotesRecovery:
    """The distributed recovery's vote, a mixin of :class:`~autobatch.training.oom.recovery.OomRecovery`."""

    _stopped_by: list[int] | None = None  # the ranks whose floor ended this step (read by the give-up message)

    def _vote(self, proposal: int, measured: bool, floor: bool, stops: bool, back: bool) -> list[list[int]]:
        """Every rank's row (one sync point)."""
        row = [proposal, int(measured), int(floor), int(stops), int(back)]
        return self._parallel.exchange(row, f"runner step {self.step}: next micro-batch")

    def _vote_stop(self) -> None:
        """This rank is at its floor with no fallback left: it gives up, and tells its peers, which
        are at the vote of :meth:`_agreed_recovery` (or giving up too)."""
        self._vote(self.micro_batch, False, True, True, False)

    def _agreed_recovery(self, before: int, back: int | None) -> tuple[int, str]:
        """The micro-batch every rank replays the step with, and the recovery's action, from the
        ranks' rows; raises (an OOM that tenacity's stop then ends the step on) where a rank gave up."""
        optimizer = self._phase == "optimizer"  # the same on every rank: optimizer_phase
        floor = back is None and not optimizer and self._at_floor()
        measured = None
        if back is not None:
            proposal = back
        elif floor or optimizer:
            proposal = before
        else:
            measured = self._measured_micro_batch()
            proposal = measured if measured is not None else (before + 1) // 2 if getattr(self, "_own_oom", True) else before
        rows = self._vote(proposal, measured is not None, floor, False, back is not None)
        stopped = [rank for rank, row in enumerate(rows) if row[STOPS]]
        if stopped:
            if back is not None:  # the try did not run: the step is undone (as an interrupted one is)
                self.result.grow_attempts.pop()
            self._stopped_by = stopped
            raise PeerOutOfMemoryError(
                f"rank {', '.join(map(str, stopped))} ran out of memory at its smallest micro-batch with no fallback left",
                self._phase, stopped)
        size = max(round_down(min(row[PROPOSAL] for row in rows), self.multiple_of), self.min_micro_batch)
        if any(row[FLOOR] for row in rows):  # the fallback, on every rank alike
            if not self._checkpointed():
                self._enable_checkpointing()
            return size, "checkpointing"
        if back is not None and size == back:
            return size, "back"
        if optimizer:  # the micro-batch does not size the optimizer step; a peer's failed grow-back try does
            return size, "back" if any(row[BACK] for row in rows) else "same"
        if any(row[MEASURED] for row in rows):
            self.growth.squeezed(before)
            return size, "measured"
        return size, "halve"

    def _stopped_reason(self, failed_at: int) -> str | None:
        """The give-up message of a rank that stopped because a peer was out of options (None: it was not)."""
        if not self._stopped_by:
            return None
        ranks = ", ".join(map(str, self._stopped_by))
        fallback = "with activation checkpointing" if self.checkpointing_fallback else "and checkpointing_fallback off"
        advice = "" if self.checkpointing_fallback else "checkpointing_fallback=True, "
        return (f"global step {self.step} ran out of memory in {self._phase} and rank {ranks} was at its smallest "
                f"micro-batch (min_micro_batch={self.min_micro_batch}) {fallback}, so every rank gives up the step "
                f"(this rank at micro-batch {failed_at}); the step was undone. Try "
                f"{advice}lower precision, a smaller model, or more device memory.")
