"""A note on an error a probe trial of batch 1 raised inside :func:`~autobatch.plan`.

When larger batches run out of memory the probe tries smaller ones, down to batch 1, and a
model that cannot train on one sample (BatchNorm in training: "Expected more than 1 value per
channel") then raises its own error, which says nothing of the search that led there. The
error is not swallowed, nor turned into "does not fit" (plan()'s checkpointing fallback is for
out-of-memory errors; a model that refuses a size is no memory figure, and a checkpointed probe
would end at batch 1 too wherever batch 2 does not fit): :func:`note_small_trial` adds a note
naming the trial's batch and what to do.
"""

from __future__ import annotations

import traceback

from ..probe.train_step import TrainStep
from .accumulation import AccumulatingStep

__all__ = ["note_small_trial", "trial_batch_size"]

#: The steps whose calls are trials: their ``batch_size`` argument is the trial's (micro-)batch.
_TRIAL_CODES = (TrainStep.__call__.__code__, AccumulatingStep.__call__.__code__)


def trial_batch_size(exc: BaseException) -> int | None:
    """The batch of the innermost trial ``exc`` was raised in (None: not in a trial's step)."""
    size = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code in _TRIAL_CODES:
            size = frame.f_locals.get("batch_size", size)
    return size if isinstance(size, int) else None


def note_small_trial(exc: BaseException) -> None:
    """Add a note to ``exc`` (an error, not an interrupt nor autobatch's own) where a trial of
    batch 1 raised it: the model may not train on one sample, and how to plan without it."""
    if not isinstance(exc, Exception) or type(exc).__module__.startswith("autobatch"):
        return
    if trial_batch_size(exc) != 1:
        return
    exc.add_note(
        "autobatch.plan: this error came from a probe trial at batch 1; the probe goes down to batch 1 when larger "
        "batches run out of memory (or starts there). If the model cannot train on one sample (BatchNorm needs more "
        "than one value per channel in training), pass multiple_of=2 (to plan(), or in a Runner's plan_options) so "
        "that no batch below 2 is tried or planned (where batch 2 does not fit, plan() then tries activation "
        "checkpointing, else raises NoBatchFitsError), or give it more memory (a larger memory_limit or device)."
    )
