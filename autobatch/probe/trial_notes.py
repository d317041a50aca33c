"""A note on an error a probe trial raised at batch 1, or at a size after other sizes passed.

When larger batches run out of memory the probe tries smaller ones, down to batch 1, and a
model that cannot train on one sample (BatchNorm in training: "Expected more than 1 value per
channel") then raises its own error, which says nothing of the search that led there. The
error is not swallowed, nor turned into "does not fit" (plan()'s checkpointing fallback is for
out-of-memory errors; a model that refuses a size is no memory figure, and a checkpointed probe
would end at batch 1 too wherever batch 2 does not fit): :func:`with_trial_note` adds a note
naming the trial's batch and what to do, where the trial runs
(:meth:`~autobatch.probe.trial.TrialRunner.run`), so every probe's caller gets it.

The same holds for a step that refuses some sizes only (a batch split in pairs, ``view(n // 2,
2, ...)``, at an odd size): the search jumps to sizes such as 1813, and the step's shape error
said nothing of why that size was tried. Where other sizes passed before, the note names them
and ``multiple_of`` (their common divisor, where the failing size is not a multiple of it), and, where
the failing size is above every size that passed (a model asserting ``x.shape[0] <= 512``: the
note said only ``multiple_of``, which a rerun with it met again), ``max_batch``. An
error at the first trial, with no size passed, is the step's at any size: it gets no note. An
``IndexError`` above batch 1 is the exception: a ``make_batch`` that indexes a dataset of fewer
samples (``X[torch.arange(n)]``) raises it at any size past the dataset's, the first trial too
(an estimate places it high), and ``multiple_of`` would not help: its note says ``max_batch``.
A ``GradScaler``'s "unscale_() has already been called" after a trial that ran out of memory
past ``unscale_`` gets a note saying to pass the scaler in ``restore``. Where the failing trial
was the first and an estimate placed it (``estimate_first``: a size in the thousands, the fake-tensor
trace having met no such error), the note says so, so that size does not look like the search's.

The note on batch 1 (``multiple_of=2``, for BatchNorm) is for a probe that came down there after
larger batches ran out of memory, or for BatchNorm's own error: a first trial at batch 1
(``strategy="binary"`` starts there) that raised a shape mismatch is the step's error at any
size, and a note naming BatchNorm sent the user the wrong way.

:func:`growth_hint` words the other contradiction a search can end in: a size passed, and later
every size down to the smallest ran out of memory. Memory held between calls grew: the step keeps
tensors alive (outputs appended to a list for metrics, a hook that keeps activations), and
"nothing fits, try checkpointing" would send the user the wrong way.
"""

from __future__ import annotations

import math
import re

from ..errors import add_note
from ..memory.units import format_bytes

__all__ = ["with_trial_note", "growth_hint", "index_hint", "exhausted_hint", "MEMORY_ERROR_HINT"]


def index_hint(batch_size: int, message: str = "") -> str:
    """What to change where the step raised ``IndexError`` at ``batch_size`` (a trial's or a trace's),
    whose text is ``message``. Two index errors are not the batch size's at all and are named as
    they are: cross-entropy's "Target 5 is out of bounds" (a class id the model has no output
    for) and an embedding's "index out of range in self" (a token id at or past its
    ``num_embeddings``); the note blamed a dataset smaller than the batch there too."""
    if re.search(r"Target -?\d+ is out of bounds", message):
        return ("a target class id is not below the model's number of outputs (cross-entropy's \"Target ... is out "
                "of bounds\"), at any batch size: make the targets' classes and the model's outputs agree.")
    if "index out of range in self" in message:
        return ("an embedding was given an id at or past its num_embeddings (torch's \"index out of range in self\"), "
                "at any batch size: make the inputs' ids (a tokenizer's vocabulary) and the embedding's size agree.")
    return (f"an index out of range at a large batch is usually make_batch (or the step) indexing a dataset or table "
            f"of fewer than {batch_size} samples. Pass max_batch=len(dataset) (to find_max_batch or plan()), or build "
            "any size by repeating samples (X[torch.arange(n) % len(X)]).")


#: the note on a Python ``MemoryError`` a trial raised (:func:`~autobatch.memory.oom.is_oom_error` is False for it)
MEMORY_ERROR_HINT = (
    "a Python MemoryError is the host's memory (a data pipeline, numpy) or the step's own, not the device "
    "allocator's, so the probe does not count it as running out of memory (autobatch.is_oom_error is False) and "
    "stops. Where host memory bounds the batch, pass max_batch (the largest size it takes); where your code raises "
    "it for the device's budget, raise torch.OutOfMemoryError instead."
)


def exhausted_hint(batch_size: int) -> str:
    """What to change where the step raised ``StopIteration`` (or a generator's "generator raised
    StopIteration", PEP 479) at ``batch_size``: its data ran out before a whole batch."""
    return (f"a StopIteration at a large batch is usually a data source with fewer than {batch_size} samples: "
            f"next(iter(DataLoader(dataset, batch_size={batch_size}, drop_last=True))) yields no batch (an iterator, "
            "a generator, exhausted the same way). Pass max_batch=len(dataset) (to find_max_batch or plan()), or build "
            "any size by repeating samples (X[torch.arange(n) % len(X)]). It is not out of memory: no smaller size "
            "was taken as the answer.")


def _ran_dry(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``StopIteration``, or the ``RuntimeError`` Python makes of one raised inside a generator."""
    return isinstance(exc, StopIteration) or (
        isinstance(exc, RuntimeError) and isinstance(exc.__cause__, StopIteration) and "raised StopIteration" in str(exc))


def with_trial_note(exc: BaseException, batch_size: int, passed: list[int] | tuple[int, ...] = (), *,
                    failed: list[int] | tuple[int, ...] | None = None, placed: str | None = None) -> BaseException:
    """``exc``, the error (not an out-of-memory one) a trial of ``batch_size`` raised, with a
    note where that trial was of batch 1 (after the sizes ``failed`` ran out of memory, or None:
    not known), or where trials of the sizes ``passed`` ran before it (not for an interrupt nor
    autobatch's own error): the model may not train on one sample, or on this size, and how to
    probe and plan without it. ``placed``: why the first trial had its size (an estimate placed
    it), said where this trial was the first."""
    if not isinstance(exc, Exception) or type(exc).__module__.startswith("autobatch"):
        return exc
    first = not passed and not failed and placed is not None
    trial = (f"the probe's first trial, at batch {batch_size} ({placed})" if first
             else f"a probe trial at batch {batch_size}")
    if isinstance(exc, RuntimeError) and "unscale_() has already been called" in str(exc):  # no size at all
        add_note(exc,
            f"autobatch: this error came from a probe trial at batch {batch_size}: an earlier trial ran out of memory "
            "after scaler.unscale_(optimizer), and the GradScaler kept its mark. Pass it to the probe as "
            "restore=(model, optimizer, scaler): the probe then clears that mark after a trial that ran out of memory "
            "(and puts the scaler's state back after the probe)."
        )
        return exc
    after = f", after trials at {_sizes(passed)} passed" if passed else ""
    if isinstance(exc, MemoryError):  # the host's (or the user's own), at any size: no OOM, no size refused
        add_note(exc, f"autobatch: this error came from {trial}{after}: {MEMORY_ERROR_HINT}")
        return exc
    if batch_size != 1 and (isinstance(exc, IndexError) or _ran_dry(exc)):  # no size the step refuses: one it cannot build
        hint = index_hint(batch_size, str(exc)) if isinstance(exc, IndexError) else exhausted_hint(batch_size)
        add_note(exc, f"autobatch: this error came from {trial}{after}: {hint}")
        return exc
    if batch_size != 1 and passed:
        divisor = math.gcd(*passed)
        why = (f": every size that passed is a multiple of {divisor} and {batch_size} is not, so the multiple it needs "
               f"divides {divisor}") if divisor > 1 and batch_size % divisor else ""
        bound = ""
        if batch_size > max(passed):  # refused for being large (an assertion, a kernel's limit), not for its factors
            bound = (f" Or it refuses sizes above a bound (a shape assertion, a kernel's or an index's limit): every "
                     f"size that passed is below {batch_size}, so pass max_batch (the largest size it takes, below "
                     f"{batch_size}) and the search tries nothing above it.")
        add_note(exc, 
            f"autobatch: this error came from a probe trial at batch {batch_size}, after trials at {_sizes(passed)} "
            "passed: the step may refuse some batch sizes (a batch split in pairs or groups). Pass multiple_of (to "
            f"find_max_batch or plan(), or in a Runner's plan_options) so that only sizes it takes are tried{why}.{bound}"
        )
        return exc
    if batch_size == 1 and (failed is None or failed or _one_sample_error(exc)):
        add_note(exc,
            "autobatch: this error came from a probe trial at batch 1; the probe goes down to batch 1 when larger "
            "batches run out of memory (or starts there). If the model cannot train on one sample (BatchNorm needs "
            "more than one value per channel in training), pass multiple_of=2 (to find_max_batch or plan(), or in a "
            "Runner's plan_options) so that no batch below 2 is tried or planned (where batch 2 does not fit, plan() "
            "then tries activation checkpointing, else raises NoBatchFitsError), or give it more memory (a larger "
            "memory_limit or device)."
        )
    return exc


def _one_sample_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a layer's refusal of a single sample: BatchNorm's "Expected more than 1
    value per channel when training" (torch's words for batch norm and instance-wise norms)."""
    return "more than 1 value per channel" in str(exc)


def _sizes(passed: list[int] | tuple[int, ...]) -> str:
    """The passed sizes for a note: all of them, or the first three and the largest."""
    ordered = sorted(passed)
    return ", ".join(map(str, ordered)) if len(ordered) <= 4 else f"{', '.join(map(str, ordered[:3]))}, ..., {ordered[-1]}"


def growth_hint(passed: list, smallest: int, held_bytes: int) -> str | None:
    """What to change where trials ran out of memory down to ``smallest`` after the trials
    ``passed`` (:class:`~autobatch.probe.records.TrialRecord`) passed at sizes at least as large,
    and memory held between trials grew: ``held_bytes``, allocated now, after the last trial's
    clean-up, is more than the first such pass began its last step with (weights, optimizer
    state). None otherwise (an allocator's wall on an accelerator holds no more)."""
    passed = [r for r in passed if r.batch_size >= smallest]
    if not passed or passed[0].resident_bytes is None or held_bytes <= passed[0].resident_bytes:
        return None
    return (
        f"batch {max(r.batch_size for r in passed)} passed earlier in this probe, yet later trials ran out of memory "
        f"down to batch {smallest}; memory held between trials grew from {format_bytes(passed[0].resident_bytes)} as "
        f"the first pass's last step began to {format_bytes(held_bytes)} now: the step keeps tensors alive from call "
        "to call (outputs or losses appended to a list, a hook that keeps activations, a cache that grows), and "
        "training would run out of memory the same way. Keep only what you need (loss.item(), out.detach().cpu()), "
        "or clear it, and probe again."
    )
