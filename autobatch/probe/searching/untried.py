"""Notes on sizes above the answer that the search never tried, so the answer is not read as more than it is.

A user reads a probe's answer as the largest batch that fits. Where sizes above it were not
tried, :func:`~autobatch.probe.searching.search.run_search` adds a note saying why and what to
pass to try them (kept here, apart from the search itself):

* :func:`untried_above_notes`: the memory line settled the next size without a trial (past the
  peak limit), or the answer's own trial met the allocator's wall.
* :func:`ceiling_note`: the search climbed to ``SEARCH_CEILING`` with no out-of-memory error.
* :func:`halving_first_note`: ``halving`` stops at its first pass, so where its first trial (1024
  by default, with no ``max_batch``) passed, nothing above was tried: a model where 5000 fits was
  answered 1024 with no word that 1024 was only where the search began.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...memory.units import format_bytes

if TYPE_CHECKING:
    from ..trial import TrialRunner

__all__ = ["untried_above_notes", "ceiling_note", "halving_first_note"]


def untried_above_notes(runner: TrialRunner, fit: dict | None, largest_passed: int, failed_above: list[int],
                        multiple_of: int) -> list[str]:
    """Why the size above the answer was not tried, where the search settled it without a trial:
    the line put it past the peak limit, or the answer's own trial met the allocator's wall."""
    notes = []
    settled = (fit or {}).get("settled_above")
    if settled is not None and settled["batch_size"] == largest_passed + multiple_of:
        slope = fit.get("refined", fit)["slope_bytes_per_sample"] * multiple_of
        notes.append(
            f"{settled['batch_size']} was not tried: the memory line through the two largest passing sizes puts "
            f"its allocated peak {format_bytes(settled['past_limit_bytes'])} past the peak limit "
            f"({settled['past_limit_bytes'] / slope:.0%} of its step's bytes per unit), and a step past it fails"
        )
    at_wall = (fit or {}).get("at_wall_above")
    if at_wall is not None and at_wall["batch_size"] == largest_passed + multiple_of and failed_above:
        notes.append(
            f"{at_wall['batch_size']} was not tried: {largest_passed}'s own trial made the allocator flush its cache "
            f"in {runner.passed_record(largest_passed).flushes} of its steps before it settled, below "
            f"{min(failed_above)}, which kept flushing; a larger step, needing more at the same wall, would not settle"
        )
    return notes


def ceiling_note(records: list, ceiling: int) -> str:
    """The note where the search reached its ceiling (``ceiling`` samples) with no failure below it."""
    return (f"reached the search ceiling ({ceiling} samples, autobatch.probe.SEARCH_CEILING) with no out-of-memory "
            f"error below it; {_flat_steps(records) or 'pass max_batch to search higher'}")


def halving_first_note(size: int, max_batch: int | None) -> str:
    """The note where ``halving`` passed its first trial (``size``) below ``max_batch`` (None: none
    given): it stops at its first pass, so no larger size was tried and ``size`` need not be the
    largest that fits. Where the first trial was ``max_batch`` itself, the search asked no more: no note."""
    higher = "or max_batch" if max_batch is None else f"(at most max_batch, {max_batch})"
    return (f"{size} was halving's first trial and passed, so no larger size was tried: it need not be the largest "
            f"that fits, only where the search began. Pass strategy='auto' for the largest size that fits, or a "
            f"larger start {higher} to halve from higher")


def _flat_steps(records: list) -> str | None:
    """Why the search reached its ceiling where its passing trials' steps took the same memory
    above their start at sizes at least 64 times apart: the function does not seem to use its
    batch size (a ``DataLoader`` built outside it keeps its own ``batch_size``), and "pass
    max_batch to search higher" was the wrong advice. None where the steps grew, or were not measured."""
    measured = [(r.batch_size, r.step_peak_bytes - r.resident_bytes) for r in records
                if r.passed and r.step_peak_bytes is not None and r.resident_bytes is not None]
    if len(measured) < 3 or max(size for size, _ in measured) < 64 * min(size for size, _ in measured):
        return None
    used = [step for _, step in measured]
    if max(used) > 1.01 * min(used) + 4096:
        return None
    return (f"its steps took the same memory at every size tried from {min(s for s, _ in measured)} to "
            f"{max(s for s, _ in measured)}, so the function does not seem to use the batch size it is given (a "
            "DataLoader built outside it keeps its own batch_size: build it inside, with batch_size=batch_size); "
            "if it does, pass max_batch to search higher")

