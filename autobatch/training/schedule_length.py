"""A scheduler too short for the fit: refused before the first step, not at its end.

torch's ``OneCycleLR`` raises ``ValueError: Tried to step 13 times. The specified number of total
steps is 12`` one step past its ``total_steps``. A fit that trains further (``epochs`` raised on a
resume, the scheduler built for the run's first length; the checkpoint's ``total_steps`` replaces the
one given, as ``load_state_dict`` sets it) trained up to that step, then crashed with torch's message,
naming a length the user had not passed, after a warning saying the run goes on and that the
settings could be set on ``runner.scheduler`` (``OneCycleLR``'s phases keep the old length, so a
``total_steps`` set there does not lengthen the cycle: past its end the cosine rose again). The fit's
last step is known before it starts wherever the data has a length (or ``steps=`` is given), so the
runner compares it with the steps the scheduler has left and raises one error naming the fixes.
Schedulers that run on past their length (every other torch one) are left alone.

A ``OneCycleLR`` inside a ``ChainedScheduler`` (each of its schedulers stepped at every step) or a
``SequentialLR`` raised the same way, mid-fit: the check looks through both (nested too). In a
``SequentialLR(milestones=[m, ...])`` the scheduler after milestone ``m`` is set to its start at step
``m`` and stepped from step ``m + 1`` until the next milestone, so a cycle there lasts to step
``m + total_steps``: it needs ``total_steps`` of the fit's last step - ``m``, and one whose next
milestone comes before the cycle's end is never stepped past it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_schedule_length", "held_schedulers"]


def check_schedule_length(scheduler: Any, last_step: int | None, step: int, *, resumed: bool,
                          epochs: int | None, steps: int | None) -> None:
    """Raise one ``ValueError`` where ``scheduler`` is, or holds (:func:`_steps_before_raise`), a
    ``OneCycleLR`` that would raise before the fit's ``last_step`` (the whole run's; ``step``: the
    steps done). ``None``: the end is unknown."""
    if last_step is None or last_step <= step:
        return
    short = _steps_before_raise(scheduler, last_step - step)
    if short is None:
        return
    taken, cycle, where = short
    total = int(cycle.total_steps)
    asked = f"epochs={epochs}" if steps is None or (epochs is not None and last_step < steps) else f"steps={steps}"
    whose = (" (the checkpoint's: a resume keeps the schedule it was written with, as load_state_dict sets "
             "total_steps)") if resumed else ""
    reach, place = step + taken, " in its place" if where else ""
    ends = f"its cycle ended at step {reach}" if reach <= step else f"fit(steps={reach}) ends the cycle"
    raise ValueError(
        f"fit({asked}) trains to step {last_step}, but the scheduler OneCycleLR{where} has total_steps={total}{whose} "
        f"and raises past it, after step {reach}: {ends}; to train to step {last_step} "
        f"with one cycle, start afresh with OneCycleLR(total_steps={total + last_step - reach}){place} (setting "
        "total_steps on it later does not lengthen its phases); or, after the cycle ends, go on at its last learning "
        "rate with Runner(scheduler=None) and fit(..., resume=...)")


def _steps_before_raise(scheduler: Any, steps: int, fresh: bool = False) -> tuple[int, Any, str] | None:
    """Of the next ``steps`` steps of ``scheduler``, those it takes before one raises: ``(taken, the
    OneCycleLR that raises, where it sits in scheduler, '' where it is scheduler)``; ``None``: it takes
    them all. ``fresh``: a ``OneCycleLR`` a ``SequentialLR`` sets to its start (step 0) at its milestone."""
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        left = int(scheduler.total_steps) - (0 if fresh else int(scheduler.last_epoch))
        return (max(left, 0), scheduler, "") if steps > left else None
    inner = held_schedulers(scheduler)
    if not inner:
        return None
    name = type(scheduler).__name__
    sequential = isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR)
    milestones = [int(m) for m in scheduler._milestones] if sequential else []
    now = int(scheduler.last_epoch) if sequential else 0  # SequentialLR's steps done; a chain steps all at once
    found: tuple[int, Any, str] | None = None
    for index, child in enumerate(inner):
        begin = milestones[index - 1] if sequential and index > 0 else None  # set to its start at this step
        end = milestones[index] if index < len(milestones) else None  # the next one's from this step on
        later = begin is not None and now < begin
        first = begin + 1 if later else now + 1  # the first step that steps it
        last = now + steps if end is None else min(now + steps, end - 1)
        if last < first:
            continue
        short = _steps_before_raise(child, last - first + 1, fresh=later)
        if short is None:
            continue
        taken = first + short[0] - 1 - now  # the steps before the one at which it raises
        if found is None or taken < found[0]:
            after = f" after its milestone {begin}" if begin is not None else ""
            found = (taken, short[1], f"{short[2]} ({name}'s scheduler {index}{after})")
    return found


def held_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers a ``SequentialLR`` or ``ChainedScheduler`` holds (its ``_schedulers``), in order;
    [] for any other scheduler. The one walk of this module's length check and of the resume's checks
    (:mod:`autobatch.training.checkpoints.resume_checks`)."""
    inner = getattr(scheduler, "_schedulers", None)
    if not (isinstance(scheduler, (torch.optim.lr_scheduler.SequentialLR, torch.optim.lr_scheduler.ChainedScheduler))
            and isinstance(inner, (list, tuple))):
        return []
    return list(inner)
