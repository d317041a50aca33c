"""Whether a stored probe result can be served as an answer (:func:`result_problem`).

A hand-edited or damaged cache entry must be a miss, never a batch size of ``"4096"``, ``0`` or
``None``: :meth:`~autobatch.probe.caching.cache.ProbeCache.get` checks every entry it reads with
this before serving it. Kept apart from the store (:mod:`~autobatch.probe.caching.cache`), which
reads, writes and clears the files.
"""

from __future__ import annotations

from typing import Any

from ..records import TrialRecord
from ..result import ProbeResult

__all__ = ["result_problem"]


def _count(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def result_problem(result: ProbeResult) -> str | None:
    """Why a stored result cannot be served as the answer, or None when it can: a hand-edited
    or damaged entry must be a miss, never a batch size of ``"4096"``, ``0`` or ``None``."""
    if not _count(result.batch_size, 1):
        return f"batch_size {result.batch_size!r} is not a positive integer"
    for name in ("multiple_of", "steps_per_trial"):
        if not _count(getattr(result, name), 1):
            return f"{name} {getattr(result, name)!r} is not a positive integer"
    for name in ("max_batch", "largest_passed", "smallest_failed", "capacity_bytes", "memory_limit_bytes"):
        value = getattr(result, name)
        if value is not None and not _count(value, 0):
            return f"{name} {value!r} is neither null nor a non-negative integer"
    # a probe answers in multiples of multiple_of, never above max_batch (both are in the key)
    if result.batch_size % result.multiple_of:
        return f"batch_size {result.batch_size} is not a multiple of multiple_of {result.multiple_of}"
    if result.max_batch is not None and result.batch_size > result.max_batch:
        return f"batch_size {result.batch_size} is above max_batch {result.max_batch}"
    if not _number(result.margin) or not 0.0 <= result.margin < 1.0:
        return f"margin {result.margin!r} is not a fraction in [0, 1)"
    if not _number(result.elapsed_s) or result.elapsed_s < 0:
        return f"elapsed_s {result.elapsed_s!r} is not a non-negative number"
    for name in ("strategy", "strategy_used", "device"):
        if not isinstance(getattr(result, name), str):
            return f"{name} {getattr(result, name)!r} is not a string"
    if not isinstance(result.notes, list) or not all(isinstance(note, str) for note in result.notes):
        return "notes is not a list of strings"
    if not isinstance(result.tested, bool):
        return f"tested {result.tested!r} is not true or false"
    # what a hit hands on or shows: a promise that is not an object crashed the hit, a
    # fallback_reason or a trial's peak that is not a number its table and summary()
    for name in ("fit", "estimate", "diagnostics", "promise"):
        if getattr(result, name) is not None and not isinstance(getattr(result, name), dict):
            return f"{name} {getattr(result, name)!r:.40} is neither null nor an object"
    if result.fallback_reason is not None and not isinstance(result.fallback_reason, str):
        return f"fallback_reason {result.fallback_reason!r} is neither null nor a string"
    return next(filter(None, map(_trial_problem, result.trials)), None)


def _trial_problem(trial: TrialRecord) -> str | None:
    """Why a stored trial cannot be shown (its size, whether it passed, its byte counts), or None."""
    if not _count(trial.batch_size, 1):
        return f"a trial's batch_size {trial.batch_size!r} is not a positive integer"
    if not isinstance(trial.passed, bool):
        return f"a trial's passed {trial.passed!r} is not true or false"
    # what the report's throughput divides by and multiplies with (text multiplied a string)
    if not _number(trial.seconds) or not trial.seconds >= 0:
        return f"a trial's seconds {trial.seconds!r:.40} is not a non-negative number"
    if trial.steps is not None and not _count(trial.steps, 1):
        return f"a trial's steps {trial.steps!r:.40} is neither null nor a positive integer"
    for name, value in vars(trial).items():
        if name.endswith("_bytes") and value is not None and not _number(value):
            return f"a trial's {name} {value!r:.40} is neither null nor a number"
    return None
