"""The runner's checkpoints and exact resume: what a run saves, and how it continues.

A mixin of :class:`~autobatch.Runner`: ``save`` writes model, optimizer, scheduler, random
states, the data position and the run's history atomically (rank 0 only;
:mod:`~autobatch.training.checkpoints.checkpoint_io`), and a resumed run replays the epoch's start and skips
the batches already trained, so it sees the same batches and draws the same random numbers
as the run that was interrupted: the global generators' and a data loader's own
(``DataLoader(generator=...)``, :func:`~autobatch.training.checkpoints.checkpoint_io.data_generators`).
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ...errors import CheckpointError, PeerFailedError, add_note
from ...memory.simulated import host_memory
from ...planning.checkpointing import enable_checkpointing
from ...probe.snapshot.shards import has_dtensors, load_plain_state, optimizer_state_for, plain_state
from .checkpoint_io import (
    CHECKPOINT_NAME, RUNNER_FORMAT, load_checkpoint, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state,
    write_cleared,
)
from .checkpoint_values import check_loose_parameters, load_loose_parameters, saved_loose_parameters, storable
from .give_up import saved_on_give_up
from ..data_size import check_same_size, no_batches, saved_size
from ..epochs import EpochBatches, epoch_length, replayed, set_epoch, started
from .extra_state import load_extra_state, saved_extra_state
from .onto_device import state_onto_device
from ..multiples import resumed_micro_batch
from ..pacing import FailedDraw, agree_epoch_length, carried_error, told_every_rank
from ..ranks import agree_resume
from ..precision import check_dtypes, load_grad_scaler, weights_dtype
from .resume_checks import check_fits, check_kinds, inner_kinds, kind, load_scheduler, position_for, precision_of, warn_changed_precision
from .resume_checks import (bare_keys, keys_as_in, local_module_names, saved_module, warn_persistent_workers,
                            warn_replaced_settings, without_wrapper_prefix)
from .resume_fresh import continues_in, earlier_path, file_mark, keep_earlier_run, put_back, replaced_since, shared_dir_error
from .resume_target import resume_target
from ..run_result import RunResult
from .sharded_files import check_sharded_resume, sharded_path

__all__ = ["Resumable", "epoch_length", "sharded_path"]

log = logging.getLogger("autobatch")


class Resumable:
    """Checkpoint and resume of a :class:`~autobatch.Runner` (which sets the attributes)."""

    _torn: str | None = None  # why the weights may hold an update the step count does not (step_guard="off")
    _epoch_samples = 0  # samples trained in the current epoch (a short batch counted as it is)
    _samples_known = True  # False: resumed from a checkpoint older than its epoch_samples (counted from position)
    _epoch_batches: int | None = None  # the data's batches an epoch (None: no length)
    _epoch_iter: EpochBatches | None = None  # the current epoch's iterator
    _fetched_at_load = False  # the loaded checkpoint's step had drawn its batch (a step stopped part-way)
    _dir_claimed = False  # checkpoint_dir is this run's: checked by its first fit(), resumed from, or saved to
    _keep_earlier = False  # a fresh fit() (or one resumed from elsewhere): another run's checkpoint there is moved aside at the first save
    _data_size: dict[str, int | None] | None = None  # the epoch's data's batches and samples (data_size)
    _own_mark: tuple[int, int, int] | None = None  # the last.pt this run wrote or resumed from (file_mark): another run's not replaced

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write a checkpoint atomically (default ``checkpoint_dir/last.pt``; a directory given
        as ``path``: its ``last.pt``, as ``fit(resume=)`` reads it); returns its path."""
        self._refuse_torn("save()")
        if path is None:
            if self.checkpoint_dir is None:
                raise ValueError("no path given and no checkpoint_dir configured")
            path = self.checkpoint_dir / CHECKPOINT_NAME
        path = resolve_checkpoint(path, self.checkpoint_dir)  # os.replace of the file over a directory failed (IsADirectoryError)
        in_dir, shared = self.checkpoint_dir is not None and path.parent.resolve() == self.checkpoint_dir.resolve(), None
        claimed, kept = (self._dir_claimed, self._keep_earlier), None  # put back, with the file kept, if nothing is written
        if in_dir:
            if self._keep_earlier or not self._dir_claimed:  # this run's first save there (fit()'s, or a save() before)
                kept = keep_earlier_run(self.checkpoint_dir, self._parallel, sharded=has_dtensors(self.model))  # raised: tried again
            elif (shared := replaced_since(self.checkpoint_dir, self._own_mark, self._parallel, sharded=has_dtensors(self.model))):
                path = earlier_path(path, shared)  # another run's last.pt is there: left alone, this run stops below
            self._dir_claimed, self._keep_earlier = True, False  # this run's, which a later fit() goes on to replace
        counted = self.result.checkpoints_saved, self.result.checkpoint_path  # put back where no file is written
        self.result.checkpoints_saved += 1  # counted in the checkpoint itself
        self._count_skips()
        sharded = has_dtensors(self.model)
        if sharded:  # FSDP2: every rank writes its own shards, nothing is gathered
            self.result.checkpoint_path = str(sharded_path(path, 0, self._parallel.world_size()))  # rank 0's file
            path = sharded_path(path)
        else:
            self.result.checkpoint_path = str(Path(path))
        ranks = None if sharded else self._ranks_random_states()  # a sync point of every rank
        written, failure = Path(path), None
        if sharded or self._parallel.is_rank_zero():  # else rank 0 writes: every rank holds its state but the random one
            try:
                state = self.state_dict()
                if ranks is not None:
                    state["rng_ranks"] = ranks
                written = save_checkpoint(state, path)
                self._own_mark = file_mark(written) if in_dir and not shared else self._own_mark
            except BaseException as exc:  # noqa: BLE001 - a Ctrl-C too: told to every rank, uncounted, re-raised
                failure = exc
                alone = not sharded and self._parallel.world_size() == 1  # ranks' flags must stay alike: not under DDP
                if put_back(kept if alone else None, path):  # the earlier run's last.pt, moved aside for nothing
                    self._dir_claimed, self._keep_earlier = claimed
                if isinstance(exc, OSError):  # a full disk: nothing trained is lost, the runner holds it
                    add_note(exc, f"autobatch: step {self.step} is trained and counted, and this runner holds its state: once "
                                  f"{write_cleared(exc)}, runner.save() writes it, and fit(data, ...) goes on from there")
        self._checkpoint_written(failure, counted)
        log.debug("checkpoint at step %d written to %s", self.step, written)
        if shared:
            raise told_every_rank(shared_dir_error(self.checkpoint_dir, written, self.step))
        return written

    def _saved_on_give_up(self, exc: BaseException) -> BaseException:
        """``exc``, after the steps trained before the run gave up are saved (:func:`saved_on_give_up`:
        with ``checkpoint_dir``; under ``torch.distributed`` where every rank gave up on the same step)."""
        return saved_on_give_up(self, exc)

    def _refuse_torn(self, doing: str) -> None:
        """Refuse to save or train on weights that may hold an update the step count does not
        (a step stopped inside or after ``optimizer.step()`` with ``step_guard="off"``, which
        keeps no copy to undo it): a checkpoint of them, or the step trained again, applies
        that update twice. The last checkpoint is left as it was."""
        if self._torn is not None:
            raise RuntimeError(
                f"{doing} refused: {self._torn}; {doing} now would apply that update twice. Resume from the last "
                "checkpoint (fit(data, resume=...)) to go on, and use step_guard='cpu' (or 'auto') so that an "
                "interrupted step is undone",
            )

    def _checkpoint_written(self, failure: BaseException | None, counted: tuple[int, str | None]) -> None:
        """The sync point that ends every save: no rank returns before every file of this checkpoint
        is complete (rank 0's ``last.pt``; each rank's shards under FSDP2), so a rank that resumes or
        reads it right after sees this step's file, never a missing or stale one. A rank whose write
        failed re-raises its error, the others raise :class:`~autobatch.errors.PeerFailedError`, and
        ``result.checkpoints_saved`` and ``checkpoint_path`` go back to ``counted`` (nothing written)."""
        rows = self._parallel.exchange([self.step, int(failure is not None)], "checkpoint: every rank's file written")
        failed = [rank for rank, row in enumerate(rows) if row[1]]
        if failure is not None or failed:  # no checkpoint written: not counted, nor named as the last one
            self.result.checkpoints_saved, self.result.checkpoint_path = counted
        if failure is not None:
            raise told_every_rank(failure)  # a save() in on_step_end: raised at once, not carried (step_end)
        if failed:
            raise PeerFailedError(
                f"rank {', '.join(map(str, failed))} could not write the checkpoint of step {self.step} (see that "
                f"rank's error); rank {self._parallel.rank()} stops too instead of going on without it", failed,
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, the parameters the optimizer trains outside it
        (a loss module's), optimizer, scheduler, RNG, data position; only values a weights-only
        load reads back (numpy scalars made Python ones, anything else a ``TypeError`` naming it)."""
        self._fill_result()
        return storable({
            "format": RUNNER_FORMAT,
            # a DTensor (FSDP2) as this rank's local shard: plain tensors, loadable with weights_only
            "model": plain_state(bare_keys(saved_module(self.model).state_dict())),  # no _orig_mod. inside either
            "loose_parameters": saved_loose_parameters(saved_module(self.model), self.optimizer),
            "optimizer": plain_state(self.optimizer.state_dict()),
            "optimizer_type": type(self.optimizer).__qualname__,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scheduler_type": kind(self.scheduler),
            "scheduler_kinds": inner_kinds(self.scheduler),  # inside a SequentialLR: its state names no class
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "extra_state": saved_extra_state(self.extra_state),  # Runner(extra_state=): an EMA model, ...
            "precision": precision_of(self._train_step),
            "rng": rng_state(self._data_generators),
            "epoch_rng": self._epoch_rng,
            "step": self.step,
            # an epoch whose iterator was run to its end is finished: the checkpoint is of the next one's start
            "epoch": self.epoch + 1 if self._epoch_ended() else self.epoch,
            "position": 0 if self._epoch_ended() else self.position,
            "epoch_samples": 0 if self._epoch_ended() else self._epoch_samples,  # the position in samples
            # the step at ``position`` had drawn its batch (stopped part-way): a resume draws it under the
            # epoch's replay, not afresh from "rng" (drawn after it); absent in older checkpoints: False
            "batch_fetched": self._batch_fetched(),
            "data_size": self._data_size,  # a mid-epoch resume on data of another size is refused (data_size.py)
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "multiple_of": self.multiple_of,  # absent in checkpoints of older versions: 1
            "growth": self.growth.state_dict(),
            "checkpointed_modules": None if self.checkpoint_handle is None else local_module_names(self.checkpoint_handle.modules, saved_module(self.model)),
            "result": self.result.to_dict(),
        })

    def _ranks_random_states(self) -> list[dict[str, Any]] | None:
        """Every rank's random states (now, and at the epoch's start), gathered for rank 0's
        checkpoint; None in one process. Ranks draw their own (dropout seeded per rank): restoring
        rank 0's on every rank made a resumed run's masks differ from the uninterrupted run's."""
        if self._parallel.world_size() <= 1:
            return None
        buffer = io.BytesIO()
        torch.save({"rng": rng_state(self._data_generators), "epoch_rng": self._epoch_rng}, buffer)
        every = self._parallel.exchange_bytes(buffer.getvalue(), "checkpoint: random states")
        return [torch.load(io.BytesIO(data), weights_only=True) for data in every]

    def _epoch_ended(self) -> bool:
        """Whether the epoch's iterator was run to its end after its last batch trained, before
        the loop counted the epoch finished (:meth:`~autobatch.training.epochs.EpochBatches.end`)."""
        ended = self._epoch_iter is not None and self._epoch_iter.ended
        return ended and self.position == self._epoch_batches

    def _epoch_iterator(self, data: Iterable[Any], resumed_rng: dict[str, Any] | None) -> EpochBatches:
        """A fresh iterator over ``data``; on resume (or a continued ``fit()``), the epoch's start
        replayed (:func:`~autobatch.training.epochs.replayed`): the batches already trained
        skipped, and the batch a step stopped part-way had drawn drawn again before the saved
        random state is put back, so a shuffled DataLoader yields the same order and the loader
        draws nothing twice, a step stopped in the epoch's first batch included. A checkpoint at
        an epoch boundary (position 0, nothing drawn: the run ended with whole epochs) starts the
        next epoch afresh from the random state it saved, as the uninterrupted run would have. A
        sampler with ``set_epoch`` (``DistributedSampler``) is told the epoch first, so each
        epoch draws its own order, a resumed one the interrupted run's. Under
        ``torch.distributed`` the ranks first agree on their data's length
        (:func:`~autobatch.training.pacing.agree_epoch_length`: uneven data is one error)."""
        fetched, self._fetched_at_load = self._batch_fetched(), False  # read before the iterator is replaced
        replays = resumed_rng is not None and not self.distributed  # skips trained batches: of data of the same size
        self._data_size = check_same_size(self._data_size if replays else None, data, self.epoch, self.position)
        self._each_step = self.distributed and agree_epoch_length(self._parallel, data, self.epoch)
        if resumed_rng is not None and (self.position > 0 or self.epoch > 0):
            warn_persistent_workers(data, self.position, self.epoch)
        set_epoch(data, self.epoch)
        if resumed_rng is not None and self._epoch_iter is not None and self._epoch_iter.continues(data, self.epoch, fetched):
            return self._epoch_iter  # a later fit() on the same generator: it goes on where it stopped
        if resumed_rng is None or self._epoch_rng is None or (self.position == 0 and not fetched):
            self._epoch_rng = rng_state(self._data_generators)
            self.position = 0
            self._epoch_iter = self._carried(
                lambda: EpochBatches(started(data, self.epoch, self._data_generators), self.epoch, data=data), data)
            return self._epoch_iter
        self._epoch_iter = self._carried(lambda: replayed(
            data, self.epoch, self._epoch_rng, resumed_rng, self._data_generators, self.position, fetched,
            self._epoch_samples if self._samples_known and not self.distributed else None), data)
        return self._epoch_iter

    def _carried(self, make: Any, data: Iterable[Any]) -> EpochBatches:
        """``make()``; under ``torch.distributed`` an error this rank's data raise making the epoch's
        iterator (``iter(data)``; a resume drawing the batches already trained) becomes the epoch's
        only batch, a :class:`~autobatch.training.pacing.FailedDraw` its step raises where every rank
        votes: its peers a ``PeerFailedError`` at once, where they had gone on into the step's collectives."""
        made = carried_error(make, self.distributed)
        return EpochBatches(iter([made]), self.epoch, drawn=self.position, data=data) if isinstance(made, FailedDraw) else made

    def _batch_fetched(self) -> bool:
        """Whether the epoch's iterator had drawn the batch at ``position`` (a step that drew it
        stopped part-way, or the runner ran the iterator to its end and found one more): a resume
        draws it again before it puts the saved random state back. After a resume, until its
        iterator is made: what the checkpoint said."""
        batches = self._epoch_iter
        if batches is None or batches.epoch != self.epoch:
            return self._fetched_at_load
        return not self._epoch_ended() and batches.drawn > self.position

    def _no_batches(self, data: Iterable[Any]) -> ValueError:
        return no_batches(data, self.epoch)  # empty data, or a one-shot iterator used up

    def _continued_rng(self) -> dict[str, Any] | None:
        """Where an earlier ``fit()`` of this runner stopped inside an epoch (by ``steps``): the
        random state now, so the next ``fit()`` replays that epoch's start and skips the batches
        it trained, as a resume does, instead of training them again; else None. The runner's
        first ``fit()`` (no ``resume=``) keeps another run's checkpoint there (:mod:`~autobatch.training.checkpoints.resume_fresh`)."""
        self._refuse_torn("fit()")
        self._keep_earlier = self._keep_earlier or (not self._dir_claimed and self.checkpoint_dir is not None)
        self._dir_claimed = True
        began = self.position > 0 or self._batch_fetched()  # stopped in the epoch's first step too
        return rng_state(self._data_generators) if began and self._epoch_rng is not None else None

    def _stopped_at_epoch_end(self, data: Iterable[Any], batches: Iterator[Any]) -> None:
        """A run stopped by ``steps`` at an epoch's last batch has completed that epoch: count it,
        as a run that went on would (its checkpoint then starts the next epoch afresh).

        ``batches`` (the epoch's iterator) is first run to its end, as the run that went on
        does: a ``DataLoader(generator=g)``'s ``RandomSampler`` draws one more permutation from
        ``g`` only when its iterator is exhausted, and without it the next epoch (resumed, or a
        second ``fit()``) trained another order than the uninterrupted run's."""
        if epoch_length(data, 1) != self.position:
            return
        try:
            next(batches)
        except StopIteration:
            self.epoch += 1
            self.position = 0
        else:  # ``len(data)`` was short of its batches: the epoch goes on (a later fit() skips the trained ones)
            log.warning("data yielded more batches than len(data) = %d; the epoch is not counted finished", self.position)

    def _fill_result(self) -> None:
        result = self.result
        result.steps, result.epochs = self.step, self.epoch
        self._count_skips()
        self._count_nonfinite()
        if getattr(self, "_last_loss", None) is not None:
            result.last_loss = float(self._last_loss)
        result.micro_batch = self.micro_batch or 0
        result.initial_micro_batch = self.initial_micro_batch or 0
        result.checkpointing = self.checkpoint_handle is not None
        result.empty_cache_fires, result.empty_cache_seconds = self.hygiene.fires, self.hygiene.seconds

    # -- resume --------------------------------------------------------------------------------
    def _read(self, resume: str | os.PathLike, sharded: bool) -> tuple[Path, dict[str, Any]]:
        """This rank's checkpoint file and its contents. Under ``torch.distributed`` the ranks
        agree first that every rank could read its file (one sync point): a checkpoint that one
        rank cannot read (missing there, truncated) is a :class:`~autobatch.errors.CheckpointError`
        on every rank, not an error on one rank while the others wait for it."""
        path, state, failure = Path(str(resume)), {}, None  # for messages; resume_target checks what it is
        try:  # this rank's file; a sharded set for another world size (or none) is one clear error
            path = check_sharded_resume(resolve_checkpoint(resume_target(resume, self.checkpoint_dir)), sharded=sharded)
            with host_memory():  # read into host memory (map_location="cpu"): no device budget counts it
                state = load_checkpoint(path, expect_format=RUNNER_FORMAT)
        except (OSError, CheckpointError, ValueError) as exc:  # ValueError: "latest" with none written here
            failure = exc
        if failure is not None and not isinstance(failure, CheckpointError) and self._parallel.world_size() > 1:
            own = CheckpointError(path, f"rank {self._parallel.rank()} cannot read it ({failure}); every rank reads "
                                  "the checkpoint: put it where every rank sees it")
            own.__cause__, failure = failure, own
        agree_resume(self._parallel, path, failure, "resume: every rank read the checkpoint", "could not read it (see "
                     "that rank's error); every rank reads the checkpoint: put it where every rank sees it")
        return path, state

    def _load(self, resume: str | os.PathLike) -> dict[str, Any]:
        sharded = has_dtensors(self.model)
        path, state = self._read(resume, sharded)
        if sharded:  # each rank wrote its file on its own: a run killed between two ranks' writes leaves a mix
            steps = [row[0] for row in self._parallel.exchange([int(state["step"])], "resume: the checkpoint's step")]
            if len(set(steps)) > 1:
                raise CheckpointError(
                    path, f"its rank files are of different steps ({steps}, by rank): the run was stopped while "
                    "the ranks wrote them; resume from a checkpoint whose files all hold one step, or start afresh",
                )
        failure, position = None, 0  # this rank's; a sharded rank reads a file no other rank reads
        try:
            check_kinds(path, state, self.optimizer, self.scheduler)  # before anything is loaded
            position = position_for(path, state, self.global_batch)  # another global batch: refused before loading too
            warn_changed_precision(state, precision_of(self._train_step), weights=weights_dtype(self.model))
            saved = state["model"] if sharded else without_wrapper_prefix(state["model"])  # nothing loaded unless all fits
            saved = keys_as_in(saved_module(self.model).state_dict(), saved)  # a compiled submodule's _orig_mod.
            check_fits(saved_module(self.model), saved, self.optimizer, state["optimizer"], sharded=sharded)  # shapes, groups
            check_dtypes(path, saved_module(self.model), saved)  # a warning, or inf
            # these refuse with their own CheckpointError, before the weights and optimizer state are loaded too
            check_loose_parameters(path, saved_module(self.model), self.optimizer, state.get("loose_parameters"))
            load_scheduler(path, self.scheduler, state["scheduler"])
            load_extra_state(path, self.extra_state, state.get("extra_state"))  # absent in older checkpoints
            if state.get("checkpointed_modules") and self.checkpoint_handle is None:
                self.checkpoint_handle = enable_checkpointing(saved_module(self.model), modules=local_module_names(state["checkpointed_modules"], saved_module(self.model)))
            warn_replaced_settings(self.optimizer, state["optimizer"], self.extra_state.values(), state.get("result"))
            if sharded:  # this rank's shards, written in place; the optimizer's state converted first, before any load
                optimizer_state = optimizer_state_for(self.optimizer, state["optimizer"])
                load_plain_state(saved_module(self.model), saved)
                self.optimizer.load_state_dict(optimizer_state)
            else:
                saved_module(self.model).load_state_dict(saved)
                self.optimizer.load_state_dict(state["optimizer"])
                state_onto_device(self.optimizer)
        except CheckpointError as exc:
            failure = exc
        except (RuntimeError, ValueError, KeyError, AttributeError) as exc:  # mismatched keys, shapes, groups, modules
            detail = " ".join(str(exc).split())[:300]
            failure = CheckpointError(
                path, f"it was written for another model or optimizer ({detail}); resume with the model it was "
                "trained with, or start afresh",
            )
        agree_resume(self._parallel, path, failure, "resume: every rank loaded the checkpoint", "could not load its "
                     "checkpoint file into the model and optimizer (see that rank's error, which says what to change); "
                     f"rank {self._parallel.rank()} stops too instead of training without it")
        load_loose_parameters(saved_module(self.model), self.optimizer, state.get("loose_parameters"))
        load_grad_scaler(self.grad_scaler, state.get("grad_scaler"))  # a disabled one holds none; settings it replaces named
        self.step, self.epoch, self._torn = state["step"], state["epoch"], None
        self._dir_claimed, self._keep_earlier = True, not continues_in(self.checkpoint_dir, path)  # else kept at the first save
        writes = has_dtensors(self.model) or self._parallel.is_rank_zero()  # rank 0 writes last.pt: its peers do not know it
        self._own_mark = file_mark(path) if writes and not self._keep_earlier else None  # its saves replace it, while there
        self._captured_at = None  # a step-guard snapshot of this runner's own step of that index is not the checkpoint's
        self._epoch_samples = state.get("epoch_samples", state["position"] * (state.get("global_batch") or 0))
        self._samples_known = "epoch_samples" in state
        self.position = position
        self._epoch_iter, self._fetched_at_load = None, bool(state.get("batch_fetched", False))
        self._data_size = saved_size(state, self.global_batch)  # absent in older checkpoints: not checked
        previous = RunResult.from_dict(state["result"])
        if self.micro_batch is None and previous.plan is not None:  # not planned again: train the plan's split
            self.balanced = bool(previous.plan.get("balanced", self.balanced))  # multiple_of: full pieces, not balanced
        if state["micro_batch"] is not None:  # None: saved before its run's first plan; this run's given, or planned
            # this run's floor, ceiling (max_micro_batch, else a given micro_batch: Runner(micro_batch=2) resumed
            # from a run at 4 trains at 2, as its grow-back never goes above 2) and multiple
            ceiling = self.growth.ceiling if self.growth.configured else self.share
            self.micro_batch = resumed_micro_batch(state, self.multiple_of, self.min_micro_batch, min(self.share, ceiling))
            self.initial_micro_batch = self.initial_micro_batch or self.micro_batch
        self.growth.load_state_dict(state["growth"], limit=self.share)
        ranks = state.get("rng_ranks")  # each rank's own random states, where the run had them
        mine = ranks[self._parallel.rank()] if ranks is not None and len(ranks) == self._parallel.world_size() else state
        self._epoch_rng, rng = mine["epoch_rng"], mine["rng"]
        for kept in ("oom_recoveries", "grow_attempts", "checkpoints_saved", "plan", "skipped_steps", "nonfinite_loss_steps"):
            setattr(self.result, kept, getattr(previous, kept))
        self.result.resumed_from = {"path": str(path), "step": self.step, "epoch": self.epoch, "position": self.position}
        log.info("resumed from %s at step %d (epoch %d, batch %d), micro-batch %s", path, self.step, self.epoch, self.position,
                 "planned on its first batch" if self.micro_batch is None else self.micro_batch)
        set_rng_state(rng, self._data_generators)
        return rng

