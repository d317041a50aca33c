"""Out-of-memory errors that no smaller micro-batch shrinks: inside ``optimizer.step()``, and after the replay.

A mixin of :class:`~autobatch.training.oom.recovery.OomRecovery`, kept apart because these OOMs
leave the micro-batch alone, where every other recovery shrinks it.

* **Inside** ``optimizer.step()`` (phase ``"optimizer"``): the step's activations are freed by
  then and the gradients are as large at any micro-batch, so a smaller one does not lower the
  step's peak. The recovery undoes the half-applied step (the step guard), empties the cache,
  moves the step guard's copy to host memory, and replays the same global batch at the **same**
  micro-batch once (action ``"same"``): a transient squeeze costs one replay, not the rest of
  the run at half the throughput. If ``optimizer.step()`` runs out of memory again, the step is
  given up (:class:`~autobatch.errors.StepOutOfMemoryError`, undone), where it used to walk the
  micro-batch down to 1 first, a replay per halving. A failed grow-back try still goes back to
  the size that trained. Every rank decides alike: the phase and this count are the same on
  every rank (:mod:`~autobatch.training.oom.recovery_vote`).
* **After** the replay (``scheduler.step()``, the buffers' re-alignment over the ranks): nothing
  is replayed (:meth:`OptimizerPhase._outside_replay`).

Measured on the CPU's simulated device (8 layers of 256 x 256, float32, 2.0 MiB of parameters):
``optimizer.step()`` of Adam/AdamW with ``foreach=True`` allocated 2.0 MiB (a temporary over the
whole parameter list), with ``foreach=False`` 0.5 MiB (two of the largest parameter); SGD with
momentum none either way. The give-up message names ``foreach=False`` where it applies; the
runner does not switch it itself (it changes the user's optimizer for the rest of the run).
"""

from __future__ import annotations

from ...errors import StepOutOfMemoryError

__all__ = ["OptimizerPhase"]


class OptimizerPhase:
    """What an OOM inside or after the optimizer step does, a mixin of the runner's recovery."""

    _optimizer_replayed: int | None = None  # the step whose optimizer-phase OOM was replayed at the same micro-batch

    def _optimizer_gives_up(self) -> bool:
        """tenacity's stop for an OOM inside ``optimizer.step()``: the step replayed at the same
        micro-batch already ran out there (the same on every rank: no vote)."""
        return self._optimizer_replayed == self.step

    def _optimizer_reason(self, failed_at: int) -> str:
        """The give-up message of a step whose optimizer step ran out of memory twice."""
        where = " and the step guard's copy in host memory" if self.guard.enabled else ""
        groups = self.optimizer.param_groups
        foreach = ("foreach" in self.optimizer.defaults
                   and any(group.get("foreach") is not False and not group.get("fused") for group in groups))
        hint = ("build the optimizer with foreach=False (torch's foreach step allocates temporaries over a whole "
                "parameter group: Adam's extra peak falls from a copy of every parameter to two of the largest), "
                if foreach else "")
        return (f"global step {self.step} ran out of memory inside optimizer.step() at micro-batch {failed_at}, and "
                f"again when the step was replayed at the same micro-batch with the cache emptied{where}. The micro-"
                "batch does not size the optimizer step (its activations are freed by then, its gradients as large at "
                "any micro-batch), so no smaller one was tried; the step was undone. The optimizer step itself does "
                f"not fit: {hint}try an optimizer with less state (SGD, Adafactor), lower precision, a smaller model, "
                "or more device memory.")

    def _outside_replay(self, micro_batch: int) -> StepOutOfMemoryError:
        """The error for an OOM raised after the step's attempts succeeded (in ``scheduler.step()``,
        or the buffers' re-alignment over the ranks): nothing was replayed, since a smaller
        micro-batch does not make that part smaller, and the message says so instead of claiming
        that the smallest micro-batch ran out (the step is undone by then, as for any error)."""
        where = "scheduler.step()" if self._phase == "scheduler" else "the step's end, after optimizer.step()"
        return StepOutOfMemoryError(self.step, self._phase, self._checkpointed(), reason=(
            f"global step {self.step} ran out of memory in {where}, after its micro-batches and optimizer step had "
            f"succeeded at micro-batch {micro_batch}: that is outside the runner's OOM replay (moving "
            "micro-batches, forward, backward, optimizer.step()), and a smaller micro-batch would not make it "
            "smaller, so nothing was replayed. The step was undone (weights, optimizer, scheduler as before it); "
            "the out-of-memory error is chained below: free memory before that call, or make it allocate less."))
