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
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_schedule_length"]


def check_schedule_length(scheduler: Any, last_step: int | None, step: int, *, resumed: bool,
                          epochs: int | None, steps: int | None) -> None:
    """Raise one ``ValueError`` where ``scheduler`` is a ``OneCycleLR`` that would raise before the
    fit's ``last_step`` (the whole run's; ``step``: the steps done). ``None``: the end is unknown."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) or last_step is None or last_step <= step:
        return
    total, done = int(scheduler.total_steps), int(scheduler.last_epoch)
    if last_step - step <= total - done:
        return
    asked = f"epochs={epochs}" if steps is None or (epochs is not None and last_step < steps) else f"steps={steps}"
    whose = (" (the checkpoint's: a resume keeps the schedule it was written with, as load_state_dict sets "
             "total_steps)") if resumed else ""
    reach = step + max(total - done, 0)
    ends = f"its cycle ended at step {reach}" if reach <= step else f"fit(steps={reach}) ends the cycle"
    raise ValueError(
        f"fit({asked}) trains to step {last_step}, but the scheduler OneCycleLR has total_steps={total}{whose} and "
        f"raises past it, after step {reach}: {ends}; to train to step {last_step} "
        f"with one cycle, start afresh with OneCycleLR(total_steps={last_step}) (setting total_steps on it "
        "later does not lengthen its phases); or, after the cycle ends, go on at its last learning rate with "
        "Runner(scheduler=None) and fit(..., resume=...)")
