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
GPUs of one process). It records neither ``gradient_accumulation_steps`` nor the world size (those
are in ``training_args.bin``, a pickle, never loaded here), so the checkpoint's run is taken to
have had this run's accumulation and number of processes, as it has when the same script resumes.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["checkpoint_batch", "checkpoint_path", "resumed_global_batch", "warn_unseen_resume"]

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


def checkpoint_batch(path: str) -> int | None:
    """The per-device batch (times one process's GPUs) the run saved at ``path`` trained, from
    its ``trainer_state.json`` (JSON only); None where the file or the field is missing."""
    try:
        with open(os.path.join(path, STATE_NAME), encoding="utf-8") as file:
            state = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"fit_batch_size: cannot read {os.path.join(path, STATE_NAME)} ({error}); pass "
                         "global_batch= (the samples per optimizer step the checkpoint's run trained)") from error
    size = state.get("train_batch_size") if isinstance(state, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def resumed_global_batch(trainer: Any, resume_from_checkpoint: str | bool | None, global_batch: int | None,
                         world: int, multiple_of: int = 1) -> int | None:
    """The ``global_batch`` to probe for: the caller's where given (a warning where it differs from
    the checkpoint's samples per step: a deliberate change), else, when the coming ``train()``
    resumes, the checkpoint's samples per step (per-device batch x this run's accumulation x
    processes). Under ``auto_find_batch_size`` None (``train()`` replaces the per-device batch
    set with the checkpoint's itself), so the probe's answer is set as without a resume. One ``ValueError`` where no multiple of ``multiple_of`` divides the
    checkpoint's samples per process, naming both ways out."""
    path = checkpoint_path(trainer, resume_from_checkpoint)
    if path is None:
        return global_batch
    args = trainer.args
    batch = checkpoint_batch(path)
    if batch is None:
        if global_batch is None:
            log.warning("fit_batch_size: the checkpoint %s records no train_batch_size, so its samples per optimizer "
                        "step cannot be kept; pass global_batch= (the samples per step it trained) so resuming "
                        "skips exactly the samples it trained", path)
        return global_batch
    per_device = batch // max(1, int(getattr(args, "n_gpu", 1) or 1))  # train_batch_size counts a DataParallel step
    trained = batch * max(1, int(args.gradient_accumulation_steps)) * world
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
