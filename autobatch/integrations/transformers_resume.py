"""Keep a resumed ``transformers.Trainer`` run's samples per optimizer step across ``fit_batch_size``.

``Trainer.train(resume_from_checkpoint=...)`` resumes at the checkpoint's optimizer step and, to
reach the samples the interrupted run had trained in the current epoch, skips
``steps_trained_in_current_epoch * gradient_accumulation_steps`` batches of the *new* per-device
size. Where the probe answers another per-device batch than the checkpoint's run trained (another
card, another cap), the samples per optimizer step change mid-run (and the learning-rate
schedule's meaning with them), and the skipped batches no longer cover the samples already
trained: some train twice, others never. Transformers restores the checkpoint's batch only under
``auto_find_batch_size``.

So, resuming without a ``global_batch``, ``fit_batch_size`` keeps the checkpoint's samples per
step: it asks for that ``global_batch``, which it meets with the largest per-device batch that
fits and the accumulation that makes up the rest. Why keep and not raise: the user resuming asked
for the run to go on, and keeping is the only answer that neither loses nor repeats a sample; a
deliberate change stays open, by passing ``global_batch=`` (warned about, not refused).

Only ``trainer_state.json`` is read (JSON: ``train_batch_size``, the per-device batch times the
GPUs of one process). Transformers records no ``gradient_accumulation_steps`` there (it is in
``training_args.bin``, a pickle, never loaded here), so ``fit_batch_size`` adds a callback whose
state ``train()`` saves in it (:func:`record_split`) and which is read back here. Without it
(a run ``fit_batch_size`` did not size), the checkpoint's run is taken to have had this run's
accumulation, and the number of processes always, as it has when the same script resumes. Why
the record: a run started with ``fit_batch_size(trainer, global_batch=16)`` trained 4 x 4, and
the same script resumed took the checkpoint's 4 with its own ``gradient_accumulation_steps=1``
for 4 samples a step: a warning told it to pass ``global_batch=4``, and without ``global_batch``
the run went on at 4 a step, silently.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["SavedSplit", "checkpoint_batch", "checkpoint_path", "record_split", "accumulation_setter", "accumulation_where",
           "restore_accumulation", "resumed_batch", "resumed_checkpoint", "resumed_global_batch", "saved_split", "split_record", "warn_unseen_resume"]

log = logging.getLogger("autobatch")

STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME


def checkpoint_path(trainer: Any, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint the coming ``train()`` resumes from, found as ``train()`` finds it: a path
    as given, ``True`` the last ``checkpoint-N`` in ``args.output_dir`` (one ``ValueError``, as
    ``train()``'s, where there is none), ``False`` none; ``None`` falls back on
    ``args.resume_from_checkpoint``, which Transformers' example scripts pass on to ``train()``."""
    if resume_from_checkpoint is None:
        resume_from_checkpoint = getattr(trainer.args, "resume_from_checkpoint", None)
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        output_dir = trainer.args.output_dir
        found = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        if found is None:
            raise ValueError(f"fit_batch_size(resume_from_checkpoint=True): no checkpoint-N folder in "
                             f"args.output_dir ({output_dir}), so train(resume_from_checkpoint=True) would fail too; "
                             "pass the checkpoint's path, or resume_from_checkpoint=False")
        return found
    return os.fspath(resume_from_checkpoint)


@dataclass(frozen=True)
class SavedSplit:
    """What the checkpoint at ``path`` says its run trained, from one read of its
    ``trainer_state.json`` (a resume read and parsed it three times or more): ``batch``, the
    per-device batch times one process's GPUs (:func:`checkpoint_batch`), ``accumulation``
    (:func:`checkpoint_accumulation`), ``stale_step``, the step an earlier run wrote a carried-over
    record at (:func:`split_record`); None where the checkpoint does not say."""

    path: str
    batch: int | None
    accumulation: int | None
    stale_step: int | None


def saved_split(path: str) -> SavedSplit:
    """The :class:`SavedSplit` of the checkpoint at ``path``, its ``trainer_state.json`` read once."""
    state = _state(path)
    record, stale = _split_record_of(state)
    size = (record or {}).get("train_batch_size") or state.get("train_batch_size")
    steps = (record or {}).get("gradient_accumulation_steps")
    return SavedSplit(path, size if _positive(size) else None, steps if _positive(steps) else None, stale)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def checkpoint_batch(path: str) -> int | None:
    """The per-device batch (times one process's GPUs) the run saved at ``path`` trained: the
    :func:`record_split` record's where the run that saved it wrote it (a resumed ``train()`` keeps
    the checkpoint's ``train_batch_size`` in its state, so after a resume at another batch the
    state's is the first run's), else its ``trainer_state.json``'s; None where neither says."""
    return saved_split(path).batch


def checkpoint_accumulation(path: str) -> int | None:
    """The ``gradient_accumulation_steps`` the run saved at ``path`` trained with, as
    :func:`record_split` recorded it in its ``trainer_state.json``; None where it recorded none,
    or where the record is an earlier run's (:func:`split_record`)."""
    return saved_split(path).accumulation


def split_record(path: str) -> tuple[dict[str, Any] | None, int | None]:
    """``(record, stale_step)``: the :func:`record_split` record of the checkpoint at ``path`` where
    the run that saved it wrote it, else ``(None, the step an earlier run wrote it at)``; ``(None,
    None)`` where it has none. Why: ``train()`` resumed without ``fit_batch_size`` loads the
    checkpoint's state, record included, and saves it unchanged in its own checkpoints, so a later
    resume read a split that run never trained (16 a step where it trained 2). A record saved before
    the step was recorded is taken as current."""
    return _split_record_of(_state(path))


def _split_record_of(state: dict[str, Any]) -> tuple[dict[str, Any] | None, int | None]:
    """:func:`split_record` of an already parsed ``trainer_state.json``."""
    record = (state.get("stateful_callbacks") or {}).get(_split_record().__name__)
    record = record[-1] if isinstance(record, list) and record else record
    record = record.get("args") if isinstance(record, dict) else None
    if not isinstance(record, dict):
        return None, None
    step = record.get("global_step")
    if isinstance(step, int) and step != state.get("global_step"):
        return None, step
    return record, None


def resumed_checkpoint(trainer: Any, resume_from_checkpoint: str | bool | None) -> SavedSplit | None:
    """The :class:`SavedSplit` of the checkpoint the coming ``train()`` resumes from (None: no
    resume), read once and passed to :func:`resumed_global_batch` and :func:`resumed_batch`."""
    path = checkpoint_path(trainer, resume_from_checkpoint)
    return None if path is None else saved_split(path)


def resumed_batch(trainer: Any, saved: SavedSplit | None) -> int | None:
    """The per-device batch the checkpoint the coming ``train()`` resumes from trained (None:
    no resume, or a state that records none)."""
    batch = None if saved is None else saved.batch
    return None if batch is None else max(1, batch // max(1, int(getattr(trainer.args, "n_gpu", 1) or 1)))


def record_split(trainer: Any, set_for: int | None = None) -> None:
    """Have the checkpoints ``train()`` saves record ``trainer.args``' accumulation (one callback
    whose state goes into ``trainer_state.json``, replacing an earlier one), and copy the
    per-device batch into ``trainer._train_batch_size``, which the ``Trainer`` copies at
    construction and ``train()`` builds its loader with. ``set_for``: the ``global_batch`` whose
    split chose the accumulation (None: it is the user's), read back by :func:`accumulation_setter`."""
    record = _split_record()
    trainer._train_batch_size = trainer.args.train_batch_size
    trainer.remove_callback(record)
    callback = record(gradient_accumulation_steps=int(trainer.args.gradient_accumulation_steps))
    callback.set_for = set_for  # not in its state(): the checkpoints' format stays as it was
    trainer.add_callback(callback)


def accumulation_setter(trainer: Any) -> int | None:
    """The ``global_batch`` of the earlier ``fit_batch_size`` call that set ``trainer.args``'
    ``gradient_accumulation_steps`` (its :func:`record_split` record, where the accumulation is still
    the one it set), else None: the accumulation is the user's. Why: a second call read the first
    call's accumulation as one "set on TrainingArguments" by the user, and told them to remove it
    from there."""
    if "transformers" not in sys.modules:  # no Trainer was sized in this process
        return None
    steps = int(trainer.args.gradient_accumulation_steps)
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(callback, _split_record()) and callback.gradient_accumulation_steps == steps:
            return getattr(callback, "set_for", None)
    return None


def accumulation_where(set_for: int | None) -> str:
    """Where the accumulation came from, for the messages' "(set on ...)": the user's
    ``TrainingArguments``, or those of an earlier ``fit_batch_size(global_batch=...)`` call
    (:func:`accumulation_setter`)."""
    if set_for is None:
        return "TrainingArguments"
    return f"TrainingArguments by an earlier fit_batch_size(global_batch={set_for}) call"


@lru_cache(maxsize=1)
def _split_record() -> type:
    """The callback class :func:`record_split` adds, made on first use (``transformers`` is
    imported only where a ``Trainer`` is sized). ``train()`` saves its ``state()`` under its class
    name in each checkpoint's ``trainer_state.json`` and, resuming, rebuilds it from ``args``."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class AutobatchSplit(TrainerCallback, ExportableState):
        """The split ``fit_batch_size`` set, saved with each checkpoint (it does nothing else): the
        accumulation, the per-device batch (times one process's GPUs) and the optimizer step it
        was saved at, so a reader can tell a record this run wrote from one carried over."""

        def __init__(self, gradient_accumulation_steps: int = 1, train_batch_size: int | None = None,
                     global_step: int | None = None) -> None:
            self.gradient_accumulation_steps = gradient_accumulation_steps
            self.train_batch_size, self.global_step = train_batch_size, global_step
            self.set_for: int | None = None  # the global_batch whose split fit_batch_size set (record_split)
            self._trainer_state: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # the split train() runs with, also where restore_callback_states_from_checkpoint
            # rebuilt this callback from the checkpoint's (older) record; and its slot in a state
            # resumed from a checkpoint saved without it, where train()'s save looks it up (KeyError).
            # The batch is args' (set by fit_batch_size), not the state's: a resumed state keeps the
            # checkpoint's train_batch_size; under auto_find_batch_size train() picks its own: None
            if int(args.gradient_accumulation_steps) != self.gradient_accumulation_steps:
                self.set_for = None  # the user changed what fit_batch_size set: theirs now
            self.gradient_accumulation_steps = int(args.gradient_accumulation_steps)
            self.train_batch_size = None if getattr(args, "auto_find_batch_size", False) else int(args.train_batch_size)
            self._trainer_state = state
            if isinstance(getattr(state, "stateful_callbacks", None), dict):
                state.stateful_callbacks.setdefault(type(self).__name__, self.state())

        def state(self) -> dict[str, Any]:
            step = getattr(self._trainer_state, "global_step", self.global_step)  # the step being saved
            return {"args": {"gradient_accumulation_steps": self.gradient_accumulation_steps,
                             "train_batch_size": self.train_batch_size, "global_step": step}, "attributes": {}}

    return AutobatchSplit


def _state(path: str) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json`` as a dict ({} where there is none)."""
    try:
        with open(os.path.join(path, STATE_NAME), encoding="utf-8") as file:
            state = json.load(file)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ValueError(f"fit_batch_size: cannot read {os.path.join(path, STATE_NAME)} ({error}); pass "
                         "global_batch= (the samples per optimizer step the checkpoint's run trained)") from error
    return state if isinstance(state, dict) else {}


def resumed_global_batch(trainer: Any, saved: SavedSplit | None, global_batch: int | None,
                         world: int, multiple_of: int = 1) -> int | None:
    """The ``global_batch`` to probe for: the caller's where given (a warning where it differs from
    the checkpoint's samples per step: a deliberate change), else, when the coming ``train()``
    resumes (``saved``: :func:`resumed_checkpoint`), the checkpoint's samples per step
    (per-device batch x its recorded or this run's accumulation x processes). Under ``auto_find_batch_size`` None (``train()`` replaces the per-device batch
    set with the checkpoint's itself), so the probe's answer is set as without a resume. One ``ValueError`` where no multiple of ``multiple_of`` divides the
    checkpoint's samples per process, naming both ways out."""
    if saved is None:
        return global_batch
    args, path, batch, stale = trainer.args, saved.path, saved.batch, saved.stale_step
    if stale is not None and global_batch is None and not getattr(args, "auto_find_batch_size", False):
        log.warning("fit_batch_size: the checkpoint %s was saved by a run fit_batch_size did not size (its split "
                    "record is from step %d, an earlier run's, and a resumed state keeps the earlier run's train_batch_size "
                    "too), so the samples per optimizer step it trained are not known: taken as its train_batch_size %s x this run's gradient_accumulation_steps=%d; pass "
                    "global_batch= (the samples per step it trained) so resuming skips exactly the samples it trained",
                    path, stale, batch, int(args.gradient_accumulation_steps))
    if batch is None:
        if global_batch is None:
            log.warning("fit_batch_size: the checkpoint %s records no train_batch_size, so its samples per optimizer "
                        "step cannot be kept; pass global_batch= (the samples per step it trained) so resuming "
                        "skips exactly the samples it trained", path)
        return global_batch
    per_device = batch // max(1, int(getattr(args, "n_gpu", 1) or 1))  # train_batch_size counts a DataParallel step
    trained = batch * (saved.accumulation or max(1, int(args.gradient_accumulation_steps))) * world
    if global_batch is not None:
        if global_batch != trained:
            log.warning("fit_batch_size: global_batch=%d, where the checkpoint %s trained %d samples per optimizer "
                        "step (per-device %d): resuming changes the samples per step, and the batches train() skips "
                        "no longer cover the samples already trained; pass global_batch=%d to keep them",
                        global_batch, path, trained, per_device, trained)
        return global_batch
    if getattr(args, "auto_find_batch_size", False):
        return None  # train() restores the checkpoint's per-device batch itself
    if (trained // world) % multiple_of:
        raise ValueError(f"fit_batch_size: the checkpoint {path} trained {trained // world} samples per optimizer step "
                         f"per process, which no batch that is a multiple of multiple_of={multiple_of} divides, so "
                         "resuming cannot keep them; lower multiple_of, or pass global_batch= to change the samples "
                         "per step deliberately")
    log.info("fit_batch_size: resuming from %s, which trained %d samples per optimizer step: keeping them "
             "(global_batch=%d); pass global_batch= to change them deliberately", path, trained, trained)
    return trained


def restore_accumulation(trainer: Any, saved: SavedSplit | None, global_batch: int | None) -> bool:
    """Whether ``train()`` takes the checkpoint's per-device batch back itself (``auto_find_batch_size``,
    resuming without ``global_batch``, a state that records the batch), so the size set is not the
    one it runs; where the checkpoint records an accumulation (one ``fit_batch_size`` set), that is
    set on ``trainer.args`` too. Why: ``train()`` restores only the batch, so a run started with
    ``global_batch=16`` at 8 x 2 and resumed by the same script (``gradient_accumulation_steps=1``)
    went on at 8 x 1, 8 samples a step, its schedule twice as long, while the INFO line named the
    probe's size; and the warning on changed samples per step compared sizes ``train()`` never ran."""
    args = trainer.args
    if saved is None or global_batch is not None or not getattr(args, "auto_find_batch_size", False) \
            or saved.batch is None:
        return False
    if saved.accumulation is not None and saved.accumulation != int(args.gradient_accumulation_steps):
        args.gradient_accumulation_steps = saved.accumulation
    log.info("fit_batch_size: resuming from %s under auto_find_batch_size: train() restores its per-device batch %d "
             "itself, not the size fit_batch_size sets, with gradient_accumulation_steps=%d%s", saved.path, saved.batch,
             int(args.gradient_accumulation_steps), "" if saved.accumulation is None else " (its recorded one)")
    return True


def warn_unseen_resume(trainer: Any, size: int) -> None:
    """A warning where ``args.output_dir`` holds a checkpoint of another per-device batch than
    ``size`` and ``fit_batch_size`` was not told of a resume: if ``train()`` resumes from it, the
    samples per step change and samples are lost or repeated; the message names what to pass."""
    output_dir = getattr(trainer.args, "output_dir", None)
    if not output_dir or not os.path.isdir(output_dir):
        return
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir)
    try:
        batch = checkpoint_batch(last) if last is not None else None
    except ValueError:  # an unreadable state: train() would say so if it resumes from it
        return
    if batch is not None and batch != trainer.args.train_batch_size:
        log.warning("fit_batch_size: per_device_train_batch_size=%d, where the checkpoint %s trained %d per device: "
                    "if train() resumes from it, pass the same resume_from_checkpoint= to fit_batch_size (it then "
                    "keeps the checkpoint's samples per step), or global_batch=", size, last, batch)
