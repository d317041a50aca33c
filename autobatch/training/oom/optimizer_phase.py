"""Out-of-memory errors that no smaller micro-batch shrinks: inside ``optimizer.step()``, and after the replay.

A mixin of :class:`~autobatch.training.oom.recovery.OomRecovery`, kept apart because these OOMs
leave the micro-batch alone, where every other recovery shrinks it.

* **Inside** ``optimizer.step()`` (phase ``"optimizer"``): the step's activations are freed by
  then and the gradients are as large at any micro-batch, so a smaller one does not lower the
  step's peak. The recovery undoes the half-applied step (the step guard), empties the cache,
  moves the step guard's copy to host memory, and replays the same global batch at the **same**
  micro-batch (action ``"same"``): a transient squeeze costs one replay, not the rest of the run
  at half the throughput. If ``optimizer.step()`` runs out of memory again and the optimizer runs
  torch's foreach step (a temporary over a whole parameter group: :func:`foreach_groups`), its
  param groups are switched to ``foreach=False`` for the rest of the run, with one warning, and the
  step replayed once more (action ``"foreach"``): the per-tensor step's temporaries are one
  parameter's. A third failure, or a second one without foreach, gives the step up
  (:class:`~autobatch.errors.StepOutOfMemoryError`, undone), where it used to walk the micro-batch
  down to 1 first, a replay per halving. A failed grow-back try still goes back to the size that
  trained. Every rank decides alike: the phase, this count and the optimizer's settings are the
  same on every rank (:mod:`~autobatch.training.oom.recovery_vote`).
* **After** the replay (``scheduler.step()``, the buffers' re-alignment over the ranks): nothing
  is replayed (:meth:`OptimizerPhase._outside_replay`).

Measured on the CPU's simulated device (8 layers of 256 x 256, float32, 2.0 MiB of parameters):
``optimizer.step()`` of Adam/AdamW with ``foreach=True`` allocated 2.0 MiB (a temporary over the
whole parameter list), with ``foreach=False`` 0.5 MiB (two of the largest parameter); SGD with
momentum none either way. On one NVIDIA H200 (``scripts/diag_optimizer_oom.py``: 1 GiB of weights,
AdamW, a 4.5 GiB cap) the foreach step ran out of memory twice at step 0, and the switch trained all
four steps at the same micro-batch (peak 4.20 GiB), where the runner used to halve it 14 times
down to 1 and give up. The switch changes no result for SGD, Adam, AdamW, RMSprop, Adagrad or
Adamax (bit-equal weights after five steps on the CPU, torch 2.13); NAdam and RAdam differ by float
rounding (4e-8).
"""

from __future__ import annotations

from ...errors import StepOutOfMemoryError
from ...probe.foreach import drop_foreach, foreach_groups  # the probe layer's: the planner asks it too

__all__ = ["OptimizerPhase", "foreach_groups"]


class OptimizerPhase:
    """What an OOM inside or after the optimizer step does, a mixin of the runner's recovery."""

    _optimizer_replayed: int | None = None  # the step whose optimizer-phase OOM was replayed at the same micro-batch
    _foreach_dropped: int | None = None  # the step at which the optimizer's groups were switched to foreach=False

    def _optimizer_gives_up(self) -> bool:
        """tenacity's stop for an OOM inside ``optimizer.step()``: the step replayed at the same
        micro-batch already ran out there, and no foreach step is left to switch off (the same on
        every rank: no vote)."""
        return self._optimizer_replayed == self.step and not foreach_groups(self.optimizer)

    def _next_optimizer_try(self) -> str:
        """The recovery action of an OOM inside ``optimizer.step()``: ``"same"`` the first time in
        this step, then ``"foreach"`` (the groups switched to ``foreach=False``, warned once)."""
        if self._optimizer_replayed != self.step:
            self._optimizer_replayed = self.step
            return "same"
        drop_foreach(self.optimizer, f"optimizer.step() ran out of memory twice in global step {self.step} at "
                                     f"micro-batch {self.micro_batch}")
        self._foreach_dropped = self.step
        return "foreach"

    def _optimizer_reason(self, failed_at: int) -> str:
        """The give-up message of a step whose optimizer step ran out of memory twice; where steps of this
        ``fit()`` stepped the optimizer before, it says so (a squeeze held since, not a step that never fits)."""
        where = " and the step guard's copy in host memory" if self.guard.enabled else ""
        dropped = (", and again with its param groups switched to foreach=False (they stay so)"
                   if self._foreach_dropped == self.step else "")
        trained = self.result.steps_this_run  # this fit()'s steps: the optimizer's state was there in each
        advice = (f"It fit in the {trained} step{'s' if trained > 1 else ''} this fit() trained before, so memory held "
                  "since then (a tensor kept between steps, another process on the device) takes the room it needs: "
                  "free it and fit again; if nothing is held, try" if trained else "The optimizer step itself does not "
                  "fit: try")
        return (f"global step {self.step} ran out of memory inside optimizer.step() at micro-batch {failed_at}, and "
                f"again when the step was replayed at the same micro-batch with the cache emptied{where}{dropped}. The micro-"
                "batch does not size the optimizer step (its activations are freed by then, its gradients as large at "
                f"any micro-batch), so no smaller one was tried; the step was undone. {advice} an optimizer with less "
                "state (SGD, Adafactor), lower precision, a smaller model, or more device memory.")

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
