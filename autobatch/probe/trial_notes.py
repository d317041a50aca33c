"""A note on an error a probe trial of batch 1 raised.

When larger batches run out of memory the probe tries smaller ones, down to batch 1, and a
model that cannot train on one sample (BatchNorm in training: "Expected more than 1 value per
channel") then raises its own error, which says nothing of the search that led there. The
error is not swallowed, nor turned into "does not fit" (plan()'s checkpointing fallback is for
out-of-memory errors; a model that refuses a size is no memory figure, and a checkpointed probe
would end at batch 1 too wherever batch 2 does not fit): :func:`with_trial_note` adds a note
naming the trial's batch and what to do, where the trial runs
(:meth:`~autobatch.probe.trial.TrialRunner.run`), so every probe's caller gets it.
"""

from __future__ import annotations

__all__ = ["with_trial_note"]


def with_trial_note(exc: BaseException, batch_size: int) -> BaseException:
    """``exc``, the error (not an out-of-memory one) a trial of ``batch_size`` raised, with a
    note where that trial was of batch 1 (not for an interrupt nor autobatch's own error): the
    model may not train on one sample, and how to probe and plan without it."""
    if batch_size == 1 and isinstance(exc, Exception) and not type(exc).__module__.startswith("autobatch"):
        exc.add_note(
            "autobatch: this error came from a probe trial at batch 1; the probe goes down to batch 1 when larger "
            "batches run out of memory (or starts there). If the model cannot train on one sample (BatchNorm needs "
            "more than one value per channel in training), pass multiple_of=2 (to find_max_batch or plan(), or in a "
            "Runner's plan_options) so that no batch below 2 is tried or planned (where batch 2 does not fit, plan() "
            "then tries activation checkpointing, else raises NoBatchFitsError), or give it more memory (a larger "
            "memory_limit or device)."
        )
    return exc
