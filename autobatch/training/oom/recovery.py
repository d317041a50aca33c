"""The runner's recovery from an out-of-memory error: undo, free, shrink, replay.

A mixin of :class:`~autobatch.Runner`, kept apart from the step loop: the phase hook that
tells where an OOM struck (and lets fault injection strike there), tenacity's retry and stop
predicates, and what happens at the top of a replay: undo a half-applied optimizer step
(:class:`~autobatch.training.oom.step_guard.StepGuard`), put back the buffers forward changed
(:class:`~autobatch.training.oom.buffer_guard.BufferGuard`) and the random generators it drew from
(:class:`~autobatch.training.oom.step_random.StepRandom`), drop the partial gradients, free memory,
pick the smaller micro-batch (never below ``min_micro_batch``; a multiple of ``multiple_of``:
:mod:`autobatch.training.multiples`), or turn on activation
checkpointing when the smallest failed; an OOM inside ``optimizer.step()``, which no micro-batch
sizes, is replayed at the same one, then without torch's foreach step, then given up (:mod:`autobatch.training.oom.optimizer_phase`). A step given up (out of options, or any other
exception, an interrupt too) is undone the same way, its micro-batch included, before the
exception propagates (:meth:`OomRecovery._abandon_step`); an error raised at a micro-batch a
recovery shrank below every size that trained, or a compiled model's error at dynamo's recompile
limit, gets a note saying so, and what to do (:mod:`autobatch.training.oom.abandon_notes`).

The smaller micro-batch is sized by measurement where the figures allow
(:class:`~autobatch.training.oom.step_memory.StepMemory`: the line of the steps' measured peaks, the
memory resident now, what the failed attempt held and the allocation that failed), so a squeeze
of a few percent costs a few percent; it is halved only when nothing better is known (no
instrument, no measured step, an OOM the figures do not explain such as an injected one).
Under ``torch.distributed`` the ranks vote, so that every rank takes the same branch to the same
size (:mod:`autobatch.training.oom.recovery_vote`).
In a step whose batch the line does not describe (it said the failed size fits), a measured pick
that fails again caps the next one's optimism (a step down at least twice its own, or to half
where that is less: an outlier batch costs a few replays, not one per 3 %), and after a step whose batch needed more than the line says, the next step tries the
size before it again (:mod:`autobatch.training.oom.growth`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ...errors import PeerOutOfMemoryError, StepOutOfMemoryError, add_note
from ... import checks
from ...memory.oom import free_memory, is_oom_error
from ...memory.units import counted
from ...planning.checkpointing import enable_checkpointing, is_checkpointed, no_blocks_hint
from ...planning.own_checkpointing import own_checkpointing
from ...probe.snapshot.ddp_reducer import rebuild_before_first_step, reset_failed_reduction
from ..multiples import round_down
from ..carried_state import note_carried_state
from ..weak_calls import weakly
from .abandon_notes import note_recompile_limit, note_shrunk
from .optimizer_phase import OptimizerPhase
from .recovery_vote import VotesRecovery
from ..run_result import Recovery
from ..sequence_first import SequenceFirst
from ..skipped_steps import CountsSkips
from .step_guard import GUARD_SPARE
from ..grad_watch import WatchesGrads
from ..split_warnings import TellsSplit

__all__ = ["OomRecovery", "checked_min_micro_batch"]

log = logging.getLogger("autobatch")


def checked_min_micro_batch(value: int, micro_batch: int | None, max_micro_batch: int | None, share: int) -> int:
    """``Runner(min_micro_batch=)``: a positive integer no larger than the batch per rank
    (``share``), the micro-batch given or its grow-back ceiling; one ``ValueError`` otherwise."""
    value = checks.positive_int("min_micro_batch", value)
    for name, bound in (("the global batch per rank", share), ("micro_batch", micro_batch),
                        ("max_micro_batch", max_micro_batch)):
        if bound is not None and value > bound:
            raise ValueError(f"min_micro_batch={value} is above {name} ({bound}): the runner would never train; "
                             f"lower min_micro_batch to at most {bound}")
    return value


class OomRecovery(CountsSkips, WatchesGrads, TellsSplit, VotesRecovery, OptimizerPhase):
    """Recovery state and steps of a :class:`~autobatch.Runner` (which sets the attributes)."""

    min_micro_batch = 1  # a recovery never shrinks the micro-batch below it (a multiple of multiple_of)
    multiple_of = 1  # every size a recovery picks is a multiple of it
    _micro_before_step: int | None = None  # the micro-batch the current step began with, put back when it is given up
    _smallest_trained: int | None = None  # the smallest micro-batch that completed a step in this run
    _last_shrink: tuple[int, int, int] | None = None  # (step, before, after) of the last recovery that shrank it
    _measured_fail: tuple[int, int] | None = None  # (step, largest piece) of the last failure a measured pick followed
    _largest_batch = 0  # samples of the largest batch (this rank's) a step began with: grow-back tries wait for one

    @functools.cached_property
    def sequence_first(self) -> SequenceFirst:
        """The model's ``batch_first=False`` modules, found at the first step (after any wrapping)."""
        return SequenceFirst(self.model)

    def _enter(self, phase: str) -> None:
        """Phase boundary: remember where we are, and let the fault injector strike."""
        self._phase = phase
        if self.faults is not None:
            self.faults(self.step, phase)
        self._watch_grads(phase)  # a loss_fn that zeroes the gradients accumulated so far: grad_watch
        if phase in ("backward", "optimizer") and self._captured_at != self.step:
            self._capture()
        if phase == "optimizer":
            self.guard.ready()
            self._stepping = True  # from here on the optimizer may have written something

    def _capture(self) -> None:
        """Snapshot what the optimizer step may change, once per global step.

        Taken when the first backward starts: parameters and optimizer state cannot change
        before the optimizer step, and by then the first forward is queued on the device, so
        the host's work of issuing the copies overlaps device work. Measured on an H200
        (``scripts/bench_runner.py``): issued at the first forward instead, the host copy cost
        +3.1 % per step against +0.65 % here. A replay keeps the snapshot: a failed step's
        writes are undone from it first.
        """
        self.guard.capture()
        self._captured_at = self.step

    def _retry_loop(self) -> Any:
        """tenacity's loop of a step's attempts: an OOM is retried (:meth:`_is_retryable`) until the
        smallest micro-batch failed with no fallback left (:meth:`_out_of_options`), at once,
        re-raising the last error."""
        # imported here so that ``import autobatch`` (the probe, the planner) works on a machine
        # where only torch is installed; the runner itself needs tenacity
        from tenacity import Retrying, retry_if_exception, wait_none

        # weakly: the runner holds this loop, which would hold the runner (weak_calls)
        return Retrying(retry=retry_if_exception(weakly(self._is_retryable)), stop=weakly(self._out_of_options),
                        wait=wait_none(), reraise=True)

    def _is_retryable(self, exc: BaseException) -> bool:
        if not is_oom_error(exc):
            return False
        self._last_error = str(exc).splitlines()[0][:600] if str(exc) else type(exc).__name__
        self._own_oom = not isinstance(exc, PeerOutOfMemoryError)  # this rank ran out, not a peer
        if self._own_oom:
            self.step_memory.caught()  # what the failed attempt held, before its tensors are freed
        self._phase = getattr(exc, "phase", self._phase)  # another rank's OOM: where it struck
        return True

    def _out_of_options(self, retry_state: Any) -> bool:
        """tenacity ``stop``: give up when the smallest micro-batch (``min_micro_batch``, a multiple of
        ``multiple_of``: N itself by default) failed and no fallback is left; distributed, every rank
        gives up with it (:mod:`~autobatch.training.oom.recovery_vote`)."""
        if self._stopped_by:
            return True  # a peer gave up: this rank's vote raised to end the step
        if self._phase == "optimizer":  # replayed once at the same micro-batch, then given up: optimizer_phase
            return self._optimizer_gives_up()
        if not self._at_floor() or self.growth.trying:
            return False
        stops = not self.checkpointing_fallback or self._checkpointed()
        if stops and self.distributed:
            self._vote_stop()
        return stops

    def _at_floor(self) -> bool:
        """Whether no allowed micro-batch cuts the current batch smaller than the failed attempt
        did: the micro-batch is ``min_micro_batch``, or (one process) every piece it ran is no
        larger. A short last batch of 2 under ``min_micro_batch=3`` ran as one piece of 2, which
        a "recovery" to 3 ran again unchanged, to fail again. Distributed, ranks' batches differ
        and every rank must decide alike: the micro-batch alone decides."""
        if self.micro_batch <= self.min_micro_batch:
            return True
        return not self.distributed and max(self._piece_sizes()) <= self.min_micro_batch

    def _retried(self, batch: Any, size: int) -> Any:
        """The step's attempts: replayed after an OOM (:meth:`_recover` first) until one succeeds.
        ``_replaying`` says whether an OOM that stops the step came from them (their options
        used up) or after them (``scheduler.step()``: :meth:`_outside_replay`)."""
        self._replaying, self._stopped_by = True, None
        rebuild_before_first_step(self.model)  # a one-process DDP's, before this step allocates
        with self.sequence_first.watch(self._piece_sizes):  # the first step only: samples cut along time?
            for attempt in self._retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self._recover()
                    self.step_memory.begin()
                    loss = self._attempt(batch, size)
        self._replaying = False
        return loss

    def _recover(self) -> None:
        """Top of a retry: undo, free, shrink. Runs outside the failed attempt's ``except``."""
        phase, before = self._phase, self.micro_batch
        self._undo_optimizer_step()
        self.buffers.restore()  # the failed attempt's forward passes updated BatchNorm's statistics
        self.random.restore()  # and drew dropout masks: the replay draws the same ones
        self.guard.demote()  # memory is short: the step guard's copy goes to host memory from now on
        self._drop_grads()
        free_memory()
        back = self.growth.on_oom()
        grow = back is not None
        if self.distributed:  # every rank the same branch and size: recovery_vote
            self.micro_batch, action = self._agreed_recovery(before, back)
        elif grow:  # a failed grow-back try returns to the size that trained
            self.micro_batch, action = back, "back"
        elif phase == "optimizer":  # the micro-batch does not size the optimizer step: the same again (optimizer_phase)
            action = "same"
        elif not self._at_floor():
            measured = self._measured_micro_batch()
            if measured is not None:
                self.micro_batch, action = max(round_down(measured, self.multiple_of), self.min_micro_batch), "measured"
                self.growth.squeezed(before)
            else:  # rounded down to a multiple: below ``before``, which is a multiple above the floor
                self.micro_batch, action = max(round_down(self._halved(before), self.multiple_of), self.min_micro_batch), "halve"
        else:
            self._enable_checkpointing()
            action = "checkpointing"
        if grow:
            self.result.grow_attempts[-1]["held"] = False
        if action == "same":  # the same size again, then without torch's foreach step (optimizer_phase)
            action = self._next_optimizer_try()
        if action in ("measured", "halve"):
            self._last_shrink = (self.step, before, self.micro_batch)
        recovery = Recovery(self.step, phase, before, self.micro_batch, action, grow, self._last_error)
        self.result.oom_recoveries.append(recovery.__dict__.copy())
        log.warning(
            "OOM at step %d in %s with micro-batch %d%s: replaying the global batch with micro-batch %d%s%s "
            "(recovery %d)",
            self.step, phase, before, " (a grow-back try)" if grow else "", self.micro_batch,
            " (sized from measured memory)" if action == "measured" else " (the same: it does not size the optimizer "
            "step)" if action == "same" else " (the same, its optimizer stepping with foreach=False)"
            if action == "foreach" else "",
            " and activation checkpointing" if action == "checkpointing" else "", len(self.result.oom_recoveries),
        )

    def _measured_micro_batch(self) -> int | None:
        """The next micro-batch from the step memory line and the failed attempt (None: halve);
        distributed, this rank's proposal to the vote (:mod:`~autobatch.training.oom.recovery_vote`)."""
        largest = max(self._piece_sizes())  # at the failed attempt's micro-batch, still the current one
        last = self._measured_fail  # a measured pick of this step that failed too: it caps this one's optimism
        previous = last[1] if last is not None and last[0] == self.step else None
        measured = self.step_memory.after_oom(largest, self._last_error, previous)
        self._measured_fail = (self.step, largest) if measured is not None else None
        return measured

    def _halved(self, before: int) -> int:
        """Half of ``before``, rounded up, and below the largest piece the failed attempt ran: a
        short batch (a ``DataLoader``'s last, 3 samples at micro-batch 8) ran as one piece of 3,
        which halving 8 to 4 replayed unchanged, to fail again. Rounded up so that an odd piece
        halves into two: 3677 samples at micro-batch 3677 went to 1838, three pieces of 1226, a
        third of the memory where half was meant. One process (distributed: the vote's)."""
        return min((before + 1) // 2, max(self._piece_sizes()) - 1)

    def _proposal(self) -> int:
        """The micro-batch the next step starts with (grow-back included). A grow-back try waits
        for a batch as large as any the run trained: on a short one (a ``DataLoader``'s last) the
        larger size cuts the batch as the smaller did, or into smaller pieces than a full batch, so
        it would "hold" without having trained at that size, and the next full batch ran out of
        memory at it, a plain recovery that did not double the wait: one more OOM in every epoch
        (distributed, where ranks' batches may differ in size but must agree on the micro-batch,
        it is tried)."""
        self.step_memory.step_started()
        squeezed = self.growth.squeezed_from is not None and not self.distributed
        proposed = self.growth.propose(self.micro_batch, fits=self.step_memory.fitting() if squeezed else None)
        self._largest_batch = max(self._largest_batch, self._local_size)
        if self.growth.trying and not self.distributed and self._local_size < self._largest_batch:
            return self.growth.cancel()  # the size that trained; the next step tries (the wait is unchanged)
        return proposed

    def _guard_room(self, extra: int) -> bool:
        """Whether the step guard's copy (``extra`` more bytes) may live on the device: the last
        step's measured peak plus it leaves a quarter of the device free (``GUARD_SPARE``)."""
        spare = self.step_memory.spare_after(extra)
        return spare is not None and spare >= GUARD_SPARE

    def _undo_optimizer_step(self) -> None:
        if not self._stepping:
            return
        if not self.guard.enabled:  # still stepping: _abandon marks the weights as holding an uncounted update
            raise StepOutOfMemoryError(
                self.step, "optimizer", self._checkpointed(),
                reason=f"global step {self.step} ran out of memory inside optimizer.step() with step_guard='off': "
                "the update may be half-applied, so replaying it would corrupt the model. Use step_guard='cpu'.",
            )
        self.guard.restore()
        self._stepping = False

    def _abandon_step(self, exc: BaseException) -> BaseException:
        """Give up on the step ``exc`` stopped (:meth:`_abandon`) and return what to raise: an
        OOM with nothing left to try becomes :class:`~autobatch.errors.StepOutOfMemoryError`;
        any other exception is returned as it is, never swallowed, with a note where it came at a
        micro-batch a recovery shrank below every size that trained (:meth:`_note_shrunk`)."""
        failed_at = self.micro_batch
        # the split's smallest piece (a last, shorter one) is what a model that cannot take few samples fails on
        pieces = self._piece_sizes() if getattr(self, "_local_size", None) else [failed_at]
        smallest, largest = min(pieces, default=failed_at), max(pieces, default=failed_at)
        self._abandon()
        if not is_oom_error(exc):
            self._note_shrunk(exc, failed_at, smallest, pieces)
            return exc
        if not getattr(self, "_replaying", True):
            return self._outside_replay(failed_at)
        reason, checkpointed = self._stopped_reason(failed_at), self._checkpointed()
        if reason is None and self._phase == "optimizer":
            reason = self._optimizer_reason(failed_at)
        if failed_at > 1 and reason is None:  # the default message is for micro-batch 1
            allowed = (f"min_micro_batch={self.min_micro_batch} and multiple_of={self.multiple_of} allow"
                       if self.multiple_of > 1 else f"min_micro_batch={self.min_micro_batch} allows")
            lower = "lower min_micro_batch or multiple_of" if self.multiple_of > 1 else "lower min_micro_batch"
            how = "with" if checkpointed else "without"
            fallback = "" if self.checkpointing_fallback or checkpointed else "checkpointing_fallback=True, "
            advice = (f"Try {fallback}lower precision, a smaller model or sequence length, more device memory, or a "
                      f"{lower} if the model trains on fewer samples.")
            held = counted(largest, "sample")  # a short batch's pieces are smaller
            where = (f"micro-batch {failed_at}, the smallest {allowed}" if largest >= failed_at else f"micro-batch "
                     f"{failed_at}, whose pieces of this batch hold at most {held}, and no smaller piece is one "
                     f"{allowed}")
            reason = f"global step {self.step} ran out of memory in {self._phase} at {where}, {how} activation checkpointing. {advice}"
        return StepOutOfMemoryError(self.step, self._phase, checkpointed, reason=reason)

    def _note_shrunk(self, exc: BaseException, failed_at: int, smallest: int, pieces: list[int]) -> None:
        """Add a note to ``exc`` (not an interrupt, not autobatch's own error) saying what the run's
        sizes had to do with it (:mod:`autobatch.training.oom.abandon_notes`): a compiled model past
        dynamo's recompile limit, state a module carries between forwards sized by an earlier micro-batch
        (:mod:`~autobatch.training.carried_state`), or a micro-batch a recovery shrank below every size that trained."""
        if not isinstance(exc, Exception) or type(exc).__module__.startswith("autobatch"):
            return
        if note_recompile_limit(exc, failed_at, self.step) or (self._phase == "forward" and note_carried_state(
                exc, self._train_step.model, pieces, self._trained_sizes, self.share)):
            return  # state a module carries between forwards, sized by an earlier micro-batch: not BatchNorm's advice
        if self._last_shrink is None:
            return
        if self._smallest_trained is None or failed_at < self._smallest_trained:
            note_shrunk(exc, failed_at, smallest, step=self.step, last_shrink=self._last_shrink,
                        fallback=self.checkpointing_fallback)

    def _completed(self) -> None:
        """The step trained: count it towards grow-back, and remember its micro-batch."""
        self.buffers.settle()  # parameters outside the optimizer that forward changed are guarded from now on
        self.growth.on_step_done(outlier=self.step_memory.outlier)
        self._smallest_trained = min(self._smallest_trained or self.micro_batch, self.micro_batch)
        self._tell_split()  # once, at the first step in several pieces: BatchNorm, spectral norm (split_warnings)

    def _abandon(self) -> None:
        """Giving up on a step (out of options, or any other exception: an interrupt, an error in
        ``loss_fn`` or ``scheduler.step()``): leave weights, optimizer, scaler, scheduler, buffers,
        random state and micro-batch as they were before it, so a checkpoint saved now, or another
        ``fit()``, does not apply its update twice, and the next step starts at the size this one
        started with (not at one a recovery shrank it to). With ``step_guard="off"`` an optimizer
        step that began cannot be undone: the runner then refuses to save or train on (:meth:`_refuse_torn`)."""
        if self._stepping:
            self._torn = (f"global step {self.step} stopped after its optimizer.step() began, with step_guard='off', "
                          "so the weights and optimizer state may hold part of an update the step count does not")
            if self.guard.enabled:
                self.guard.restore()
                self._torn = None
            self._stepping = False
        self._captured_at = None  # the next attempt of this step takes a fresh snapshot
        self._measured_fail = None
        self._optimizer_replayed = None  # a fit() that starts this step again gets its replay too
        self.buffers.restore()
        self.random.restore()
        self._drop_grads()
        back = self.growth.cancel()
        if back is not None:  # an interrupted grow-back try: back to the size that worked, tried again later
            self.result.grow_attempts.pop()
        started = self._micro_before_step if self._micro_before_step is not None else back
        if started is not None:  # a grow-back try's size, or one a recovery shrank it to, is undone too
            self.micro_batch = started

    def _step_scheduler(self) -> None:
        """``scheduler.step()``; one that fails part-way is put back as it was (with the step),
        where it has ``state_dict()`` (an object with ``step()`` alone cannot be put back)."""
        state_dict = getattr(self.scheduler, "state_dict", None)
        saved = state_dict() if callable(state_dict) else None
        self._phase = "scheduler"  # an OOM here is not the replay's: :meth:`_outside_replay`
        self._note_applied_lrs()  # on_step_end's info["lr"]: the rates this step applied, before the scheduler's
        try:
            self.scheduler.step()
        except BaseException:
            if saved is not None:
                self.scheduler.load_state_dict(saved)
            raise

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.model.parameters():
            param.grad = None
        reset_failed_reduction(self.model)  # a one-process DDP's reducer, left mid-backward

    def _checkpointed(self) -> bool:
        """Whether the model's blocks recompute their activations: the runner's fallback, or a
        plan's ``apply(model)`` before the runner (the error said "without activation
        checkpointing ... enable checkpointing_fallback=True" there, and the fallback found no
        block left to wrap)."""
        return self.checkpoint_handle is not None or any(is_checkpointed(module) for module in self.model.modules())

    def _enable_checkpointing(self) -> None:
        """The fallback at the smallest micro-batch; none for a model that checkpoints its own blocks
        (Transformers' ``gradient_checkpointing_enable()``: a recompute nested in theirs frees nothing)."""
        handle = None if own_checkpointing(self.model) else enable_checkpointing(self.model, self.checkpoint_targets)
        if handle is None or not handle.modules:
            raise StepOutOfMemoryError(
                self.step, self._phase, False,
                reason=f"global step {self.step} ran out of memory at micro-batch {self.micro_batch} and activation "
                f"checkpointing wrapped no block: {no_blocks_hint(self.model, self.checkpoint_targets)}.",
            )
        self.checkpoint_handle = handle
