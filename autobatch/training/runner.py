"""Runner: training that survives out-of-memory errors without losing a sample or a step.

An OOM at step 40,000 costs one replayed step, not the run. For every global batch the
runner zeroes gradients, splits the batch into micro-batches, accumulates their gradients
(:func:`~autobatch.accumulated_step`, the one accumulation implementation: each micro-batch's
mean loss weighted by its size / the global batch) and steps the optimizer exactly once.

On an OOM anywhere in the global step (moving a micro-batch to the device, forward,
backward, ``optimizer.step()``) the attempt is abandoned and retried with tenacity
(``for attempt in Retrying(...)``). At the top of the next attempt, outside any ``except``
block and after tenacity has dropped the failed attempt's traceback, the runner undoes a
half-applied optimizer step (:class:`~autobatch.training.oom.step_guard.StepGuard`), puts back the
buffers forward changed (:class:`~autobatch.training.oom.buffer_guard.BufferGuard`) and the random
state (:class:`~autobatch.training.oom.step_random.StepRandom`), drops the partial gradients, frees
memory, steps the micro-batch down (by what it measured, else by half; read from runner state on
every attempt) and replays the *same* global batch from its first sample; an OOM inside
``optimizer.step()``, which no micro-batch sizes, is replayed at the same micro-batch, then with
``foreach=False``, then given up (:mod:`~autobatch.training.oom.optimizer_phase`). When micro-batch 1 (``min_micro_batch``) fails it
turns on activation checkpointing if ``checkpointing_fallback`` allows, else raises
:class:`~autobatch.errors.StepOutOfMemoryError`. Any other exception (a ``KeyboardInterrupt`` too)
propagates unchanged but for a note where a recovery's smaller micro-batch is its likely cause,
after the step is undone the same way (its micro-batch too), so a checkpoint saved then, or
another ``fit()``, does not count its update twice.

Around that loop: grow-back (:mod:`autobatch.training.oom.growth`), cache hygiene
(:mod:`autobatch.training.hygiene`), atomic checkpoints and exact resume
(:mod:`autobatch.training.checkpoints.checkpoint_io`), progress (:mod:`autobatch.training.progress`) and fault injection
(:mod:`autobatch.training.oom.faults`). Everything is configured with plain keyword values, so a config
file maps onto ``Runner(**options)``; :func:`~autobatch.train` (:mod:`autobatch.training.train_call`) is the
one call a CLI needs.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Mapping

import torch

from .. import checks
from ..errors import StepOutOfMemoryError
from ..memory.units import counted
from ..planning.accumulation import accumulated_step, batch_size_of
from ..planning.checkpointing import CheckpointHandle, find_blocks
from ..probe.snapshot.shards import has_dtensors
from ..probe.train_step import TrainStep
from . import ranks
from .batch_ops import to_device
from .oom.buffer_guard import BufferGuard
from .checkpoints.checkpoint_io import data_generators
from .checkpoints.checkpoint_values import check_storable
from .checkpoints.extra_state import check_extra_state, check_not_data
from .oom.faults import FaultInjector
from .oom.growth import GrowBack
from .hygiene import CachePolicy
from .autoplan import PlansFromData, no_batches
from .inputs import FIT_ALIASES, RUNNER_ALIASES, RUNNER_PLAN_KEYWORDS, capped_micro_batch, check_data, check_optimizer, checked_micro_batch, check_kinds, check_options, model_device, share_of, warn_batch_size, warn_growing_momentum
from .multiples import SplitsInMultiples, multiple_options
from .pacing import FailedDraw, carried_error
from .precision import warn_unscaled_float16
from .progress import Progress
from .schedule_length import check_schedule_length
from .weak_calls import weakly
from .oom.recovery import OomRecovery
from .checkpoints.resume import Resumable, epoch_length
from .data_size import unbatched_note
from .step_end import EndsSteps
from .run_result import RunResult
from .oom.step_guard import StepGuard
from .oom.step_memory import StepMemory
from .oom.step_random import StepRandom
from .stop_request import Stoppable, saves_on_sigterm

__all__ = ["Runner"]

log = logging.getLogger("autobatch")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Runner(OomRecovery, SplitsInMultiples, EndsSteps, Resumable, PlansFromData, Stoppable):
    """Train ``model`` on global batches of ``global_batch`` samples, surviving OOMs.

    Args:
        model: what to train, already on its device.
        optimizer: the optimizer of ``model``'s parameters.
        loss_fn: ``loss_fn(model, micro_batch)`` returns the *mean* loss over the micro-batch.
        global_batch: samples per optimizer step (the size of the batches ``data`` yields).
        micro_batch: samples per forward/backward (above the global batch: capped to it, with a warning); None: plan it with
            :func:`~autobatch.plan` on the first global batch (``plan_options`` go to it).
        scheduler: stepped once after every optimizer step (not ``ReduceLROnPlateau``: it needs a metric).
        device: where micro-batches are moved (default: the model's device); one this machine has.
        balanced: split policy of :func:`~autobatch.split_batch` (sizes differ by at most one).
        max_micro_batch: no micro-batch goes above it, grow-back's tries, a plan and a resume's
            included (default: the planned probe maximum, else the starting micro-batch).
        min_micro_batch: an OOM recovery never shrinks the micro-batch below it (default 1): a
            model that cannot train on fewer samples (BatchNorm: more than one) gives up with
            ``StepOutOfMemoryError`` there, or turns on ``checkpointing_fallback``, instead. No
            piece of a split is smaller (15 by 2 is ``3, 2, ...``, not ``..., 2, 1``).
        multiple_of: every micro-batch trained is a multiple of it (tensor cores; a model that needs
            an even batch): the split, a recovery's smaller size, grow-back, and ``multiple_of`` itself
            the smallest size (``min_micro_batch`` is rounded up to a multiple); the batch per rank
            and ``micro_batch`` must be multiples. Taken from ``plan_options["multiple_of"]`` when only
            that is given; see :mod:`autobatch.training.multiples`.
        grow_after: consecutive OOM-free steps before trying double the micro-batch; None or
            0 turns grow-back off. The wait doubles after each failed try.
        step_guard: ``"auto"`` (default) / ``"cpu"`` / ``"device"``: snapshot parameters and
            optimizer state before each optimizer step so an OOM inside it is replayed safely,
            in host memory (``"cpu"``), device memory (``"device"``), or on the device while a
            quarter of it stays free with the copy there and in host memory otherwise
            (``"auto"``); ``"off"``: no snapshot, and an OOM inside ``optimizer.step()`` raises
            instead of replaying.
        checkpointing_fallback: when micro-batch 1 OOMs, turn on activation checkpointing of
            the repeated blocks (``checkpoint_targets``: class names, classes or the model's modules) and replay.
        empty_cache_every: cache hygiene: empty the allocator's cache every N steps (off by default).
        empty_cache_threshold: cache hygiene: empty it when reserved - allocated exceeds this
            (bytes or "2GiB"; off by default).
        checkpoint_dir: write ``checkpoint_dir/last.pt`` atomically at the end of the run and
            every ``checkpoint_every`` steps.
        checkpoint_every: steps between checkpoints (None: only at the end); needs ``checkpoint_dir``.
        extra_state: what else the checkpoints hold, by name: objects with ``state_dict()`` and
            ``load_state_dict()`` (an EMA model updated in ``on_step_end``), put back on resume.
        progress: tqdm bar True / False / None (when stderr is a terminal or a notebook's); ``log_every``:
            log-line period without a bar.
        autocast_dtype: run forward and loss under ``torch.autocast`` (e.g. ``"bfloat16"``).
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 (with ``autocast_dtype="float16"``):
            losses are scaled, steps with inf/NaN gradients are skipped as ``GradScaler``
            does (counted in ``result.skipped_steps``), and a replay after an OOM leaves the
            scaler as a run without the OOM would (the step guard holds its state).
        max_grad_norm: clip the accumulated gradients' total norm to this before each optimizer
            step (``torch.nn.utils.clip_grad_norm_``, after unscaling with a grad scaler): the
            global batch's gradient, so the clipped step is the same whatever the micro-batch.
        faults: a :class:`~autobatch.FaultInjector` (or use :func:`~autobatch.inject_oom`).
        no_sync: e.g. DDP's ``model.no_sync``, wrapping every micro-batch but the last.
        plan_options: keyword arguments for :func:`~autobatch.plan` when ``micro_batch`` is None.
        distributed: run the data-parallel step of :mod:`autobatch.dist.step` (None: when
            a ``torch.distributed`` group of more than one rank is active here: build the Runner
            after ``init_process_group()``, or ``fit()`` in a group refuses to train). ``global_batch`` is
            then global across ranks: each rank's ``data`` yields its share, ``global_batch /
            world_size`` samples; ``micro_batch`` is per rank. A DDP ``model`` trains through DDP
            itself (its bucketed all-reduce overlaps the last micro-batch's backward; a rank
            that fails part-way completes its peers' buckets before every rank votes and
            replays, see :mod:`autobatch.dist.ddp_step`); checkpoints are written by rank 0 only.
    """

    @checks.keywords(RUNNER_ALIASES, inside=RUNNER_PLAN_KEYWORDS)
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        global_batch: int,
        micro_batch: int | None = None,
        scheduler: Any = None,
        device: str | torch.device | None = None,
        balanced: bool = True,
        max_micro_batch: int | None = None,
        min_micro_batch: int = 1,
        multiple_of: int = 1,
        grow_after: int | None = 100,
        step_guard: str = "auto",
        checkpointing_fallback: bool = False,
        checkpoint_targets: Iterable[str | type | torch.nn.Module] | None = None,
        empty_cache_every: int | None = None,
        empty_cache_threshold: int | str | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        extra_state: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        log_every: int | None = 50,
        autocast_dtype: str | torch.dtype | None = None,
        grad_scaler: "torch.amp.GradScaler | None" = None,
        max_grad_norm: float | None = None,
        faults: FaultInjector | None = None,
        no_sync: Callable[[], ContextManager] | None = None,
        plan_options: Mapping[str, Any] | None = None,
        distributed: bool | None = None,
    ) -> None:
        checks.module("model", model)
        checks.materialized("model", model)
        check_optimizer(optimizer, model)  # one, of the model's parameters; trainable ones it leaves out are named
        global_batch = checks.positive_int("global_batch", global_batch)  # a plain int (a NumPy one is taken)
        micro_batch = checked_micro_batch(micro_batch, global_batch)  # a Plan: one error naming plan.micro_batch
        max_micro_batch = checks.positive_int("max_micro_batch", max_micro_batch, allow_none=True)
        plan_options = check_kinds(balanced=balanced, checkpointing_fallback=checkpointing_fallback, distributed=distributed, progress=progress,
                                   log_every=log_every, faults=faults, no_sync=no_sync, scheduler=scheduler, plan_options=plan_options, optimizer=optimizer)
        self.model = model
        self._parallel, self.distributed = ranks.choose(distributed)  # None: whether a group of several ranks is active
        ranks.check_no_sync(no_sync, self.distributed)  # a static-graph DDP's no_sync fails in torch's reducer
        self.share = share_of(global_batch, self._parallel.world_size()) if self.distributed else global_batch
        check_options(device, checkpoint_dir, checkpoint_every, writes=self._parallel.is_rank_zero() or has_dtensors(model))
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = checks.scheduler("scheduler", scheduler)
        self.global_batch = global_batch
        self.micro_batch = capped_micro_batch(micro_batch, self.share, self.distributed)  # a warning where above it
        self.initial_micro_batch = self.micro_batch
        self.device = torch.device(device) if device is not None else model_device(model)
        self.max_micro_batch = max_micro_batch
        self.plan_options = plan_options  # a multiple_of > 1 goes to the planner too
        self.multiple_of, self.balanced, self.min_micro_batch = multiple_options(
            multiple_of, self.plan_options, share=self.share, micro_batch=micro_batch, max_micro_batch=max_micro_batch,
            min_micro_batch=min_micro_batch, balanced=balanced, per_rank=self.distributed)
        self.grow_after = grow_after
        self.grad_scaler = grad_scaler
        self.guard = StepGuard(optimizer, step_guard, grad_scaler, room=weakly(self._guard_room))  # no cycle: weak_calls
        self.buffers = BufferGuard(model, optimizer)  # what forward changed (BatchNorm statistics), undone on a replay
        self.random = StepRandom(self.device)  # the step's random state: a replay draws the same dropout masks
        self.checkpointing_fallback = checkpointing_fallback
        self.checkpoint_targets = checkpoint_targets
        if checkpoint_targets is not None:  # targets that match nothing fail now, not at an OOM mid-run
            find_blocks(model, checkpoint_targets)
        self.hygiene = CachePolicy(empty_cache_every, empty_cache_threshold, device=self.device)
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir).expanduser()  # not ./~
        self.checkpoint_every = checkpoint_every or None
        self.extra_state = check_extra_state(extra_state)  # saved in every checkpoint, loaded on resume
        self.progress, self.log_every = progress, log_every
        self.faults = faults
        self.no_sync = no_sync
        local = self._parallel.local_module(model)
        self._train_step = TrainStep(
            local, optimizer, loss_fn, make_batch=no_batches, autocast_dtype=checks.dtype("autocast_dtype", autocast_dtype),
            grad_scaler=grad_scaler, max_grad_norm=max_grad_norm,
        )
        warn_unscaled_float16(optimizer, local, self._train_step.autocast_dtype, grad_scaler, self.device)  # lost grads
        warn_growing_momentum(self._train_step)  # SGD momentum on a sparse embedding: grows every step
        given = max_micro_batch or self.micro_batch  # else planned (a resume takes its checkpoint's)
        self.growth = GrowBack(grow_after, min(given or self.share, self.share), configured=given is not None,
                               multiple_of=self.multiple_of)
        self.step_memory = StepMemory(self.device)
        self.checkpoint_handle: CheckpointHandle | None = None
        # Position: global steps done in the whole run, epoch, batches done in that epoch.
        self.step = self.epoch = self.position = 0
        self.result = RunResult(global_batch=global_batch)
        self._phase = "transfer"
        self._stepping = False
        self._last_loss: float | torch.Tensor | None = None
        self._captured_at: int | None = None
        self._last_error = ""
        self._epoch_rng: dict[str, Any] | None = None
        self._data_generators: list[Any] = []  # the data loader's own, saved beside the global ones
        self._warned_size = False
        self._local_size = self._global_size = global_batch
        self._retrying = self._retry_loop()

    # -- the public loop --------------------------------------------------------------------
    @checks.keywords(FIT_ALIASES)
    @saves_on_sigterm  # a preempted job saves its progress before it ends
    def fit(
        self,
        data: Iterable[Any],
        *,
        epochs: int | None = None,
        steps: int | None = None,
        resume: str | os.PathLike | None = None,
        on_step_end: Callable[[dict[str, Any]], None] | None = None,
    ) -> RunResult:
        """Train on ``data`` (an iterable of global batches, re-iterated once per epoch).

        Stops after ``epochs`` passes or when ``steps`` global steps are done in the whole
        run, whichever comes first (neither: one epoch), or early after a whole step on
        :meth:`request_stop` (``result.stopped``). ``resume``: a checkpoint file or directory
        written by this runner, or ``"latest"`` (the one in ``checkpoint_dir``); training continues from it exactly (same batches,
        same random numbers; not those of ``DataLoader(persistent_workers=True)``'s workers, which
        no checkpoint holds: see ``docs/runner.md``). ``on_step_end(info)`` is called after each applied update with
        ``step`` (steps done), ``epoch``, ``loss``, ``micro_batch``, ``accumulation`` (this
        rank's micro-batches in the step), ``samples`` (the step's samples, over all ranks when
        distributed) and ``lr``/``lrs`` (the rates it applied); under ``torch.distributed`` an error it raises on some rank stops every
        rank at the next step (undone) or at the end of ``fit`` (:mod:`autobatch.training.step_end`).
        Returns the :class:`~autobatch.RunResult`: a copy of ``runner.result``, the live record, which a later ``fit()`` updates.
        """
        if epochs is None and steps is None:
            epochs = 1
        epochs = checks.positive_int("epochs", epochs, allow_none=True)
        steps = checks.positive_int("steps", steps, allow_none=True)
        if on_step_end is not None:  # else "'str' object is not callable" after the first step had trained
            checks.function("on_step_end", on_step_end, "on_step_end(info: dict)")
        check_data(data, self.share)  # not one batch (a tensor, a dict, a tuple of tensors), nor unbatched samples
        check_not_data(self.extra_state, data)  # a stream's own position: a resume would skip its batches twice
        if self.checkpoint_dir is not None:  # a value no checkpoint holds: refused now, not after checkpoint_every steps
            check_storable(self.optimizer, self.scheduler, self.extra_state)
        self._parallel.check_world(self.model)  # built in this world: not before init_process_group() or after destroy
        if self.distributed:  # before anything is loaded: a save or a resume on some ranks only hangs the others
            ranks.agree_fit(self._parallel, ("max_grad_norm",), resume=resume is not None, epochs=epochs, steps=steps,
                            **ranks.runner_settings(self))  # its checkpoints, gradient, and how an OOM is replayed
            ranks.agree_model(self._parallel, self.model)  # one model: the broadcast and all-reduce pair like sizes
        began = time.perf_counter()
        # read before the data's generators replace the last fit()'s: a new loader's own (fresh) generator would
        # be set back to its first epoch's state after the replay, and the next epoch repeat that order
        continued = self._continued_rng() if resume is None else None
        self._data_generators, self._epoch_batches = data_generators(data), epoch_length(data, 1)
        self._unbatched_note = unbatched_note(data, self.share)  # a batch_size=None stream's size error names it
        first_epoch = self._hook_failure = self._step_saved = None  # not an earlier fit()'s hook error, nor save
        resumed_rng = self._load(resume) if resume is not None else continued
        total = min((n for n in (steps, epoch_length(data, epochs)) if n is not None), default=None)  # what ends first
        check_schedule_length(self.scheduler, total, self.step, resumed=resume is not None, epochs=epochs, steps=steps)
        if self.micro_batch is None:  # planned on the first batch it trains, then trained: the first epoch's, or
            # a resumed one's where the run stopped before its first plan (an interrupt in it, then save())
            first_epoch = self._plan_first(self._epoch_iterator(data, resumed_rng))
        if self.distributed:  # every rank starts from rank 0's weights
            self._parallel.start(self.model)  # as given: a wrapper's own buffer settings hold
            log.info("distributed: %d ranks, global batch %d = %d per rank, micro-batch %d per rank",
                     self._parallel.world_size(), self.global_batch, self.share, self.micro_batch)
        result = self.result
        result.steps_this_run, result.samples, result.stopped, result.stop_reason = 0, 0, False, None  # not an earlier stop
        progress = Progress(total, initial=self.step, bar=self.progress, log_every=self.log_every)
        stopped = False  # request_stop(): agreed by every rank after a step
        try:
            while not stopped and (epochs is None or self.epoch < epochs) and (steps is None or self.step < steps):
                batches = first_epoch if first_epoch is not None else self._epoch_iterator(data, resumed_rng)
                resumed_rng = first_epoch = None
                ran = False
                for batch in self._paced(batches):  # under torch.distributed: on every rank, or an error
                    ran = True
                    loss, size = self._stepped(batch)  # _global_step; an error carried into it raised as itself
                    self._after_step(loss, size, progress, on_step_end)
                    stopped = self._stop_agreed()
                    if stopped or (steps is not None and self.step >= steps):
                        self._stopped_at_epoch_end(data, batches)
                        break
                else:
                    if not ran and self.position == 0:
                        raise self._saved_on_give_up(self._no_batches(data))
                    self.epoch += 1
                    self.position = 0
            self._hooks_returned(epochs, steps)  # an on_step_end error of the last step, on every rank alike
        except StepOutOfMemoryError as exc:  # the step was undone: the steps before it are saved
            raise self._saved_on_give_up(exc)
        finally:
            self._clear_stop()
            progress.close()
            result.elapsed_s = time.perf_counter() - began
        result.stopped = self._ended_early(stopped, epochs, steps)
        if self.checkpoint_dir is not None:
            self._save_end()  # not again where its last step's checkpoint_every save holds it
            self._clear_stop()  # one the save's sync points carried, after the run's last step
        self._fill_result()
        log.info("training done: %s (%d this run), %s in %.2f s, %s, micro-batch %d", counted(result.steps, "step"), result.steps_this_run,
                 counted(result.samples, "sample"), result.elapsed_s, counted(len(result.oom_recoveries), "OOM recovery", "OOM recoveries"), self.micro_batch)
        return result.snapshot()  # not rewritten by a later fit()

    # -- one global step, with OOM recovery ----------------------------------------------------
    def _global_step(self, batch: Any) -> tuple[float | torch.Tensor, int]:
        # a batch this rank failed to draw, size or cut (distributed): its step raises the error where every rank votes
        batch = batch if isinstance(batch, FailedDraw) else carried_error(lambda: self._sized(batch), self.distributed)
        size = self._local_size = self.share if isinstance(batch, FailedDraw) else batch_size_of(batch)
        if size != self.share and not self._warned_size:
            self._warned_size = True  # one line per rank: which is it
            warn_batch_size(size, self.share, self.multiple_of, f"rank {self._parallel.rank()}: " if self.distributed else "",
                            self._parallel.world_size() if self.distributed else 1)
        self._stepping = False  # a new step: its optimizer has not run yet
        self._micro_before_step, self.micro_batch = self.micro_batch, self._proposal()
        if self.growth.trying:
            self.result.grow_attempts.append({"step": self.step, "from": self.growth.previous, "to": self.micro_batch, "held": True})
        scale = self._scale()
        self.buffers.capture()
        self.random.capture()
        try:  # any exception, an interrupt too, leaves the runner as it was before this step
            loss = self._retried(batch, size)
            if self.distributed:
                size = self._global_size
                self._parallel.after_step(self.model, f"runner step {self.step}")  # the wrapper: its buffers, its flag
            if self.scheduler is not None:
                self._step_scheduler()  # after the update it follows, undone with it
            self._stepping = False
        except BaseException as exc:
            error = self._abandon_step(exc)  # the step undone; what to raise: exc itself, or StepOutOfMemoryError
            if error is exc:
                raise
            raise error from exc
        self.step_memory.record(self._piece_sizes()[0])
        self._completed()
        if scale is not None:
            self._note_skip(scale)  # GradScaler backed off: it skipped this step (counted on the device)
        return loss, size

    def _attempt(self, batch: Any, size: int) -> float | torch.Tensor:
        self._phase = "transfer"
        if self.distributed:
            loss, self._global_size = self._parallel.step(
                self._train_step, self._micro_batches(batch), local_size=size, on_phase=self._enter,
                phase=lambda: self._phase, label=f"runner step {self.step}", global_batch=self.global_batch,
            )
            return loss
        return accumulated_step(  # lazy: read when reported (progress, on_step_end, the result), not every step
            self._train_step, self._micro_batches(batch), global_batch=size, no_sync=self.no_sync,
            on_phase=self._enter, lazy=True,
        )

    def _transfer(self, micro: Any) -> Any:
        self._enter("transfer")
        return to_device(micro, self.device)

