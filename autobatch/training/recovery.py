"""The runner's recovery from an out-of-memory error: undo, free, shrink, replay.

A mixin of :class:`~autobatch.Runner`, kept apart from the step loop: the phase hook that
tells where an OOM struck (and lets fault injection strike there), tenacity's retry and stop
predicates, and what happens at the top of a replay: undo a half-applied optimizer step
(:class:`~autobatch.training.step_guard.StepGuard`), put back the buffers forward changed
(:class:`~autobatch.training.buffer_guard.BufferGuard`) and the random generators it drew from
(:class:`~autobatch.training.step_random.StepRandom`), drop the partial gradients, free memory,
pick the smaller micro-batch, or turn on activation checkpointing when micro-batch 1 failed. A
step given up (out of options, or any other exception, an interrupt too) is undone the same
way before the exception propagates (:meth:`OomRecovery._abandon`).

The smaller micro-batch is sized by measurement where the figures allow
(:class:`~autobatch.training.step_memory.StepMemory`: the line of the steps' measured peaks, the
memory resident now, the failed attempt's peak and the allocation that failed), so a squeeze
of a few percent costs a few percent; it is halved only when nothing better is known (no
instrument, no measured step, an OOM the figures do not explain such as an injected one, and
under ``torch.distributed``, where every rank must pick the same size from the same facts).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import PeerOutOfMemoryError, StepOutOfMemoryError
from ..memory.oom import free_memory, is_oom_error
from ..planning.accumulation import micro_batch_sizes
from ..planning.checkpointing import enable_checkpointing
from .run_result import Recovery
from .step_guard import GUARD_SPARE

__all__ = ["OomRecovery"]

log = logging.getLogger("autobatch")


class OomRecovery:
    """Recovery state and steps of a :class:`~autobatch.Runner` (which sets the attributes)."""

    def _enter(self, phase: str) -> None:
        """Phase boundary: remember where we are, and let the fault injector strike."""
        self._phase = phase
        if self.faults is not None:
            self.faults(self.step, phase)
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

    def _is_retryable(self, exc: BaseException) -> bool:
        if not is_oom_error(exc):
            return False
        self._last_error = str(exc).splitlines()[0][:600] if str(exc) else type(exc).__name__
        self._own_oom = not isinstance(exc, PeerOutOfMemoryError)  # this rank ran out, not a peer
        self._phase = getattr(exc, "phase", self._phase)  # another rank's OOM: where it struck
        return True

    def _out_of_options(self, retry_state: Any) -> bool:
        """tenacity ``stop``: give up when micro-batch 1 failed and no fallback is left."""
        if self.micro_batch > 1 or self.growth.trying:
            return False
        return not self.checkpointing_fallback or self.checkpoint_handle is not None

    def _retried(self, batch: Any, size: int) -> Any:
        """The step's attempts: replayed after an OOM (:meth:`_recover` first) until one succeeds."""
        for attempt in self._retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    self._recover()
                self.step_memory.begin()
                loss = self._attempt(batch, size)
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
        action = "halve"
        if grow:
            self.micro_batch = back
            self.result.grow_attempts[-1]["held"] = False
        elif before > 1:
            measured = self._measured_micro_batch(before)
            if measured is not None:
                self.micro_batch, action = measured, "measured"
                self.growth.squeezed(before)
            else:
                self.micro_batch = before // 2
        else:
            self._enable_checkpointing()
            action = "checkpointing"
        recovery = Recovery(self.step, phase, before, self.micro_batch, action, grow, self._last_error)
        self.result.oom_recoveries.append(recovery.__dict__.copy())
        log.warning(
            "OOM at step %d in %s with micro-batch %d%s: replaying the global batch with micro-batch %d%s%s "
            "(recovery %d)",
            self.step, phase, before, " (a grow-back try)" if grow else "", self.micro_batch,
            " (sized from measured memory)" if action == "measured" else "",
            " and activation checkpointing" if action == "checkpointing" else "", len(self.result.oom_recoveries),
        )

    def _measured_micro_batch(self, before: int) -> int | None:
        """The next micro-batch from the step memory line and the failed attempt (None: halve).

        Distributed, every rank proposes one and the ranks take the smallest (one sync point,
        every rank recovers at the same place): a rank that ran out proposes its measured size,
        or half when its figures do not explain the failure; a rank that did not run out
        proposes its own line's size, or ``before``. None when no rank had figures."""
        largest = micro_batch_sizes(self._local_size, before, balanced=self.balanced)[0]
        measured = self.step_memory.after_oom(largest, self._last_error)
        if not self.distributed:
            return measured
        fallback = before // 2 if getattr(self, "_own_oom", True) else before
        proposal = measured if measured is not None else fallback
        rows = self._parallel.exchange([proposal, int(measured is not None)], f"runner step {self.step}: next micro-batch")
        if not any(row[1] for row in rows):
            return None
        return max(1, min(row[0] for row in rows))

    def _proposal(self) -> int:
        """The micro-batch the next step starts with (grow-back included)."""
        squeezed = self.growth.squeezed_from is not None and not self.distributed
        return self.growth.propose(self.micro_batch, fits=self.step_memory.fitting() if squeezed else None)

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
                self.step, "optimizer", self.checkpoint_handle is not None,
                reason=f"global step {self.step} ran out of memory inside optimizer.step() with step_guard='off': "
                "the update may be half-applied, so replaying it would corrupt the model. Use step_guard='cpu'.",
            )
        self.guard.restore()
        self._stepping = False

    def _abandon(self) -> None:
        """Giving up on a step (out of options, or any other exception: an interrupt, an error in
        ``loss_fn`` or ``scheduler.step()``): leave weights, optimizer, scaler, scheduler, buffers,
        random state and micro-batch as they were before it, so a checkpoint saved now, or another
        ``fit()``, does not apply its update twice. With ``step_guard="off"`` an optimizer step
        that began cannot be undone: the runner then refuses to save or train on (:meth:`_refuse_torn`)."""
        if self._stepping:
            self._torn = (f"global step {self.step} stopped after its optimizer.step() began, with step_guard='off', "
                          "so the weights and optimizer state may hold part of an update the step count does not")
            if self.guard.enabled:
                self.guard.restore()
                self._torn = None
            self._stepping = False
        self._captured_at = None  # the next attempt of this step takes a fresh snapshot
        self.buffers.restore()
        self.random.restore()
        self._drop_grads()
        back = self.growth.cancel()
        if back is not None:  # an interrupted grow-back try: back to the size that worked, tried again later
            self.micro_batch = back
            self.result.grow_attempts.pop()

    def _step_scheduler(self) -> None:
        """``scheduler.step()``; one that fails part-way is put back as it was (with the step),
        where it has ``state_dict()`` (an object with ``step()`` alone cannot be put back)."""
        state_dict = getattr(self.scheduler, "state_dict", None)
        saved = state_dict() if callable(state_dict) else None
        try:
            self.scheduler.step()
        except BaseException:
            if saved is not None:
                self.scheduler.load_state_dict(saved)
            raise

    def _scale(self) -> float | None:
        scaler = self.grad_scaler
        return None if scaler is None or not scaler.is_enabled() else scaler.get_scale()

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.model.parameters():
            param.grad = None

    def _enable_checkpointing(self) -> None:
        handle = enable_checkpointing(self.model, self.checkpoint_targets)
        if not handle.modules:
            raise StepOutOfMemoryError(
                self.step, self._phase, False,
                reason=f"global step {self.step} ran out of memory at micro-batch 1 and activation checkpointing "
                "found no repeated blocks to wrap; name the block classes in checkpoint_targets.",
            )
        self.checkpoint_handle = handle
