"""What the runner does between steps: count the step, report it, call ``on_step_end``, save it.

The step is counted in ``runner.result`` before the hook (``steps``, ``epochs``, ``samples``,
``steps_this_run``, the NaN and skipped steps where the loss is read), so a hook reading
``runner.result.steps`` sees the step that just ended, as ``info["step"]`` does; before,
``steps`` was set only by a save and at the end of ``fit()``, and read 0 in a fresh run's hooks.
``fit()``'s last checkpoint is not written again where the ``checkpoint_every`` save of its last
step holds it already (:meth:`EndsSteps._save_end`).

The step's checkpoint (``checkpoint_every``) is written after its hook: what the hook changes for
the steps after it (an EMA model in ``extra_state``, a learning rate set by hand, a parameter group
added to unfreeze a layer) is part of the step, and a resume runs no hook of a step it does not
train. Written before the hook, the checkpoint of step N held step N-1's EMA and learning rate,
and the resumed run trained step N+1 with them (a hand-written warmup: 0.003 off the
uninterrupted run's weights).

A mixin of :class:`~autobatch.Runner`. Under ``torch.distributed`` the ``on_step_end`` hook runs
on every rank, and an error it raises on one rank (rank 0's tracker call failing, your own
evaluation between steps) must reach the others: raised there at once, it left its peers in
the next step's collectives (inside DDP's gradient buckets, under the default group's timeout:
30 minutes for gloo) for as long as that rank's process lived on. So there the error is kept
(:meth:`EndsSteps._call_hook`, with a note saying which step's hook raised it) and carried to the
next sync point every rank passes, as an error drawing a batch is
(:mod:`~autobatch.training.pacing`): in place of the next batch drawn, raised by the next step's
vote (or by the agreement before it, where the ranks check each step's batch), the step undone
as any failed step is; after the run's last step, by one sync point at the end of ``fit()``,
before its last checkpoint (:func:`~autobatch.training.pacing.every_rank_returned`). That rank
raises its own error (its type, traceback and cause), its peers a
:class:`~autobatch.errors.PeerFailedError` naming it; ranks whose hooks all raised each raise
their own. The step whose hook raised is complete: counted, and saved where ``checkpoint_every``
fell on it (after the hook raised), as in one process, where the error propagates at once, after
that save.

A loss that is NaN or infinite is no out-of-memory error: the step is applied, not replayed (an
fp16 ``GradScaler`` skips such steps itself, counted as ``result.skipped_steps``). Without one, the
optimizer applied NaN gradients and the weights are NaN from then on; before, the run went on to
its end without a word. The runner counts such steps on the device (no step waits for it), reads
the count where it reads the loss anyway (the progress report, ``on_step_end``, the result, a
checkpoint), adds it to ``result.nonfinite_loss_steps`` and warns once, naming the first such step.

``KeyboardInterrupt`` and other ``BaseException`` are not held back, nor errors a sync point
inside the hook already told every rank of (a ``runner.save()`` in it whose write failed:
:func:`~autobatch.training.pacing.told_every_rank`, its peers' ``PeerFailedError``), nor a
``RankDisagreementError`` there (a ``save()`` on one rank only: the ranks are out of step
already): a next step would wait for peers that left.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterator

import torch

from ..errors import PeerFailedError, PeerOutOfMemoryError, RankDisagreementError, add_note
from ..memory.units import counted
from .hook_modes import HookModes
from .pacing import FailedDraw, RaisedBeforeStep, every_rank_returned, for_steps, was_told
from .progress import Progress

__all__ = ["EndsSteps"]

#: errors between ranks that a hook's own sync point raised (a ``runner.save()`` in it): not carried
_BETWEEN_RANKS = (RankDisagreementError, PeerFailedError, PeerOutOfMemoryError)

log = logging.getLogger("autobatch")


class EndsSteps:
    """The runner's work between steps (a mixin of :class:`~autobatch.Runner`, which sets the attributes)."""

    _hook_failure: FailedDraw | None = None  # this rank's on_step_end error, not raised yet (distributed)
    _step_saved: tuple[Any, ...] | None = None  # this fit()'s last checkpoint_every save (_saved_place)
    _nonfinite: tuple[torch.Tensor, torch.Tensor] | None = None  # (steps, first step) with a NaN/inf loss, not read yet
    _warned_nonfinite = False
    _warned_twice = False  # the runner's scheduler stepped outside it too (_note_applied_lrs)

    def _after_step(self, loss: float | torch.Tensor, size: int, progress: Progress,
                    on_step_end: Callable[[dict[str, Any]], None] | None) -> None:
        self.step += 1
        self.position += 1
        self._scheduler_seen = (self.step, _step_marks(self.scheduler))  # what on_step_end, loss_fn may step: _note_applied_lrs
        self._epoch_samples = (self._epoch_samples if self.position > 1 else 0) + size
        result = self.result
        result.steps_this_run += 1
        result.samples += size
        result.steps, result.epochs = self.step, self.epoch  # current in on_step_end (else set only by a save, the end)
        self._last_loss = loss  # maybe a tensor still being computed: read when reported
        if self.hygiene.after_step(self.step):
            result.empty_cache_fires, result.empty_cache_seconds = self.hygiene.fires, self.hygiene.seconds
        accumulation = len(self._piece_sizes())
        progress.update(self.step, size, self.micro_batch, accumulation, len(result.oom_recoveries), loss)
        self._note_loss(loss)
        if on_step_end is not None or progress.shows(self.step):  # the loss is read there anyway
            self._count_nonfinite()
            self._count_skips()  # result.skipped_steps as of this step, as the hook reads runner.result
        due = self.checkpoint_every and self.checkpoint_dir is not None and self.step % self.checkpoint_every == 0
        try:
            if on_step_end is not None:
                self._call_hook(on_step_end, lambda: {
                    "step": self.step, "epoch": self.epoch, "loss": float(loss), "micro_batch": self.micro_batch,
                    "accumulation": accumulation, "samples": size, **self._applied_lr(), "grad_norm": self._grad_norm(),
                })  # fmt: skip
        except BaseException:
            # the step is complete: its checkpoint is written, then the hook's error (or a Ctrl-C inside it) raised.
            # In one process only: distributed, a hook's error is held for the next sync point, and one raised here
            # is between ranks
            if due and not self.distributed:
                self._save_step()
            raise
        if due:
            self._save_step()

    def _note_loss(self, loss: float | torch.Tensor) -> None:
        """Count the step just applied (``self.step - 1``) where its loss is NaN or infinite, on the
        device (read by :meth:`_count_nonfinite`); not with an enabled grad scaler, which skips such steps."""
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            return
        if not isinstance(loss, torch.Tensor):
            if not math.isfinite(float(loss)):
                loss = torch.tensor(float(loss))
            else:
                return
        bad = ~torch.isfinite(loss.detach()).reshape(())
        if self._nonfinite is None:
            self._nonfinite = bad.to(torch.int64), torch.where(bad, self.step - 1, -1)
        else:
            count, first = self._nonfinite
            self._nonfinite = count + bad, torch.where((first < 0) & bad, self.step - 1, first)

    def _count_nonfinite(self) -> None:
        """Add the steps counted by :meth:`_note_loss` to ``result.nonfinite_loss_steps`` (one read)
        and warn, once, where there are any."""
        if self._nonfinite is None:
            return
        count, first = (int(value) for value in self._nonfinite)
        self._nonfinite = None
        self.result.nonfinite_loss_steps += count
        if count and not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning(
                "the loss was NaN or infinite at step %d (steps count from 0; %d such step(s) so far: "
                "result.nonfinite_loss_steps): no out-of-memory error, so the step was applied, not replayed, and its "
                "gradients were NaN or infinite, so the weights may be too. Look for the cause (learning rate, a bad "
                "sample, a log or division by zero in loss_fn); to end a run there, raise an error in on_step_end when "
                "info['loss'] is not finite (fit() then writes no final checkpoint; request_stop() would save these "
                "weights); fp16 with grad_scaler skips such steps", first, count)

    def _save_step(self) -> None:
        """The ``checkpoint_every`` checkpoint of the step just trained (and its hook run)."""
        if self.position == self._epoch_batches and not getattr(self, "_each_step", False):
            self._epoch_iter.end()  # the epoch's last batch: the checkpoint is of the next epoch's start
        written = self.result.checkpoints_saved
        try:
            self.save()
        except KeyboardInterrupt:  # a signal held during the write (the command line's): raised once it is written
            if self.result.checkpoints_saved > written:  # (one that stopped the write put the count back)
                self._step_saved = self._saved_place()
            raise
        self._step_saved = self._saved_place()

    def _saved_place(self) -> tuple[Any, ...]:
        """Where a checkpoint written now resumes: the step, and the epoch, position and drawn batch
        as :meth:`~autobatch.training.checkpoints.resume.Resumable.state_dict` writes them; and
        whether its result records an early stop (``result.stopped``, ``stop_reason``)."""
        ended, result = self._epoch_ended(), self.result
        return (self.step, self.epoch + 1 if ended else self.epoch, 0 if ended else self.position,
                self._batch_fetched(), result.stopped, result.stop_reason)

    def _save_end(self) -> None:
        """``fit()``'s last checkpoint, unless the ``checkpoint_every`` save of its last step holds
        it already: nothing trains, runs a hook or draws a batch after that save, so the same step
        at the same place is the same state (written twice before, ``result.checkpoints_saved``
        one too many). An epoch counted finished after it (the data's iterator run to its end
        there, not by the save) is another place, and a run stopped early another result
        (``stopped``): written."""
        if not self._holds_step_save():
            self.save()

    def _holds_step_save(self) -> bool:
        """Whether this ``fit()``'s last ``checkpoint_every`` checkpoint holds the runner's state now
        (:meth:`_save_end`; the command line's stop after a signal held during that write, which
        wrote the same step a second time before: :func:`autobatch.cli.interrupt.stopped`)."""
        return self._step_saved is not None and self._step_saved == self._saved_place()

    def _call_hook(self, hook: Callable[[dict[str, Any]], None], info: Callable[[], dict[str, Any]]) -> None:
        """``hook(info())``; under ``torch.distributed`` an error it raises is kept, to be raised
        where every rank learns of it (see the module)."""
        modes = self._hook_modes = getattr(self, "_hook_modes", None) or HookModes()
        modes.before(self.model)  # an evaluation in the hook that forgets model.train(): put back, warned
        try:
            hook(info())
        except BaseException as exc:  # noqa: BLE001 - not swallowed: raised now, or at the next sync point of every rank
            # an evaluation that raised (its OOM) left the model in eval mode: a later fit() trained so without a word
            modes.after(self.step, warn=False)
            if not self.distributed or not isinstance(exc, Exception) or isinstance(exc, _BETWEEN_RANKS) or was_told(exc):
                raise  # a sync point in the hook (its save()) told every rank already, or the ranks are out of step
            add_note(exc, f"autobatch: raised by on_step_end after step {self.step} (that step is trained and "
                          "counted); under torch.distributed it is raised at the next point every rank passes (the "
                          "next step, undone, or the end of fit(), before its checkpoint), so the other ranks stop too")
            self._hook_failure = FailedDraw(exc, after=self.step)
            return
        modes.after(self.step)

    def _note_applied_lrs(self) -> None:
        """Keep the learning rates the step applied, before ``scheduler.step()`` changes them (a tensor
        ``lr``, which a scheduler fills in place, copied: no device sync in a step). Where the runner's
        ``scheduler`` was stepped since the runner last stepped it (a ``scheduler.step()`` kept in
        ``on_step_end`` or ``loss_fn``, as in the loop the run was ported from), it steps twice a step and
        its schedule runs ahead (a 10-step warmup done in 5) without a word: warned, once."""
        seen = getattr(self, "_scheduler_seen", None)
        if seen is not None and seen[0] == self.step and _step_marks(self.scheduler) != seen[1] and not self._warned_twice:
            self._warned_twice = True
            log.warning(
                "the runner's scheduler (%s) was stepped outside the runner after step %d (steps count from 0): a "
                "scheduler.step() in on_step_end or loss_fn. The runner steps its scheduler once after every optimizer "
                "step itself, so it now steps twice a step and the schedule runs ahead of the steps; remove that "
                "scheduler.step(), or pass scheduler=None and step it there yourself", type(self.scheduler).__name__,
                self.step - 1)
        self._applied_lrs = [lr.clone() if isinstance(lr := group["lr"], torch.Tensor) else lr
                             for group in self.optimizer.param_groups]

    def _applied_lr(self) -> dict[str, Any]:
        """``lr`` and ``lrs`` of ``on_step_end``'s info: the learning rates the step just applied (its
        first param group's, every group's). The optimizer's own are the next step's once the runner's
        ``scheduler`` stepped, so a hook logging ``optimizer.param_groups[0]["lr"]`` logged each step
        with the next one's rate (the first step's 0.1 as 0.05 under ``StepLR(gamma=0.5)``)."""
        lrs = getattr(self, "_applied_lrs", None) if self.scheduler is not None else None  # before scheduler.step()
        lrs = [float(lr) for lr in lrs] if lrs is not None else [float(g["lr"]) for g in self.optimizer.param_groups]
        return {"lr": lrs[0] if lrs else None, "lrs": lrs}

    def _grad_norm(self) -> float | None:
        """``grad_norm`` of ``on_step_end``'s info: with ``max_grad_norm``, the global batch's accumulated
        gradient norm before clipping (of the attempt applied, through a replay); else None, not computed. The
        gradients themselves are gone by the hook (freed after the step, where an evaluation needs the room)."""
        norm = self._train_step.grad_norm
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor, the same on every rank
        return None if norm is None else float(norm)

    def _take_hook_failure(self) -> FailedDraw | None:
        """This rank's ``on_step_end`` error not raised yet (None the next time: it is raised now)."""
        failure, self._hook_failure = self._hook_failure, None
        return failure

    def _paced(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The epoch's ``batches`` as the step loop takes them (:func:`~autobatch.training.pacing.for_steps`)."""
        return for_steps(self._parallel if self.distributed else None, batches, getattr(self, "_each_step", False),
                         lambda: self.step, self.epoch, lambda: self.position, self._take_hook_failure,
                         self._saved_on_give_up)  # a data error alone: the steps trained are saved

    def _stepped(self, batch: Any) -> tuple[float | torch.Tensor, int]:
        """:meth:`_global_step`; an error this rank carried into it (its data's, its hook's:
        :class:`~autobatch.training.pacing.RaisedBeforeStep`) is raised as itself once the step is
        undone, outside the handler, so its own context and cause are what a traceback shows."""
        try:
            loss, size = self._global_step(batch)
        except RaisedBeforeStep as exc:
            error = exc.failed.error
        else:
            if isinstance(loss, torch.Tensor) and loss.device.type == "cpu":
                # read now: the host waits for nothing, and the tensor, kept until reported, sat beside the next
                # step, over the probe's answer by its bytes where the simulated device measured that answer exactly
                loss = float(loss)
            return loss, size
        raise error

    def _hooks_returned(self, epochs: int | None, steps: int | None) -> None:
        """The end of a ``fit()`` whose loop ended (every rank alike): under ``torch.distributed``
        an ``on_step_end`` error of its last step raises on every rank (one sync point), before the
        run's last checkpoint, which a run stopped by an error does not write in one process either.
        A loop that trained no step found the run complete already (a resume, or a second ``fit()``,
        given ``steps`` or ``epochs`` the run had reached): said, as "N more steps" is a usual misreading."""
        failure = self._take_hook_failure()
        if self.distributed:
            every_rank_returned(self._parallel, failure, self.step)
        if not self.result.steps_this_run:
            by_steps = steps is not None and self.step >= steps
            limit = f"steps={steps}" if by_steps else f"epochs={epochs}"
            # a loop of one fit() per epoch (validation between them) is the usual way to meet this
            loop = (f"; one more epoch per call, in a loop that validates between them: fit(data, "
                    f"epochs=runner.epoch + 1), here epochs={self.epoch + 1}") if not by_steps else ""
            log.warning("fit() trained no step: the run has done %s and %s already, which reach %s (steps and "
                        "epochs count the whole run, resumed parts included); pass a larger one to train on%s",
                        counted(self.step, "step"), counted(self.epoch, "full epoch"), limit, loop)


def _step_marks(scheduler: Any) -> tuple[Any, ...]:
    """What a ``scheduler.step()`` moves: the ``last_epoch`` of ``scheduler`` and of the schedulers it
    steps (``ChainedScheduler`` counts none itself); an object without one gives nothing to compare."""
    parts = () if scheduler is None else (scheduler, *getattr(scheduler, "_schedulers", ()))
    return tuple(getattr(part, "last_epoch", None) for part in parts)
