"""When the answer must also pass in a new process's layout (issue 16).

Training from scratch starts with no optimizer state: its first step makes Adam's moments among
that step's freed activations, where the probe's trials ran beside state made before them. In
that layout the state splits the segments the activations freed, and a request that needed one
of them whole gets a new segment instead: under fixed segments that costs up to the largest
request the step makes. :func:`in_fresh_layout` runs the answer's settle trial in that layout
once more (the state dropped, the cache returned, the first step making it again) and steps down
to the largest size that passes there.

A hand loop's ``TrainStep`` (whose state the probe's restore drops) is always checked. A plain
callable, and a ``TrainStep`` the ``Runner`` trains, are checked where the step's largest request
is at least :data:`LARGE_REQUEST_FRACTION` of the capacity, under fixed segments (the largest
segment after the answer's trial: :meth:`~autobatch.memory.devices.AcceleratorMemory.largest_segment`).
Measured on an H200 (8 GiB cap, bf16, AdamW, ``scripts/bench_promise.py --no-cli --resumed``):

* an LSTM language model whose loss reads 2 GiB of float logits (a quarter of the cap) answered
  66 as a ``TrainStep`` and 59 as a plain callable; the ``Runner`` at 66 recovered at its second
  step in the probing process, a new one and a resumed one, and a new process's hand loop at 52
  and 56 ran out of memory at its second step. Checked, both answer 51, which trained 200 steps
  in all three with no recovery (1.1 and 1.2 s of probing);
* GPT-2 small (its logits' float copy 1 GiB, an eighth) passed the check at its answer, 5;
* ResNet-50 and ViT-B/16 (requests of a few percent) are not checked: their probes are as before.
  Checked anyway (on an H100, thirteenth session), ResNet-50's plain answer lost a size that
  trains in new processes (177 → 176) and the probe took 3.9 s against Accelerate's 1.4 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .settling import step_down

if TYPE_CHECKING:
    from .trial import TrialRunner

__all__ = ["FreshLayout", "LARGE_REQUEST_FRACTION", "in_fresh_layout"]

#: Outside a hand loop's ``TrainStep``, the answer is checked in a new process's layout where the
#: step's largest request is at least this fraction of the capacity (module docstring: the LSTM's
#: quarter needed it, GPT-2's eighth passed it, a few percent never needed it)
LARGE_REQUEST_FRACTION = 0.1


@dataclass
class FreshLayout:
    """How to lay a trial out as a new process's first step has it (``drop``: drop the state the
    trials made and return the cache), and whether the answer needs that check: ``always`` (a hand
    loop's ``TrainStep``), else where ``memory``'s largest segment after the last trial (its largest
    request; :meth:`~autobatch.memory.devices.AcceleratorMemory.largest_segment`) is a large part
    of the capacity."""

    drop: Callable[[], object]
    memory: object
    always: bool = False
    #: under torch.distributed, whether any rank needs it (every rank then runs the same trials)
    agree: Callable[[bool], bool] = bool

    def __call__(self) -> object:
        return self.drop()

    def needed(self, capacity: int | None) -> bool:
        """Whether the answer must pass in this layout too (module docstring), on any rank: each
        rank measures its own largest segment, and ranks on either side of the line would run
        different trials (their per-trial agreement raised ``RankDisagreementError``)."""
        if self.always:
            return True
        largest = getattr(self.memory, "largest_segment", None)
        size = None if largest is None or not capacity else largest()
        return self.agree(size is not None and size >= LARGE_REQUEST_FRACTION * capacity)


def in_fresh_layout(runner: TrialRunner, units: int, multiple_of: int, layout: FreshLayout,
                    confirm: Callable[[int], int | None]) -> int | None:
    """The answer (in units) once it also passed a settle trial whose optimizer state its first
    step makes among that step's activations (``layout`` drops the state the trials made and
    returns the cache), where the other settle trials ran beside state laid out as a resumed run
    has it: the largest size that passes in that layout, then a full trial in the trials' own
    (where that fails, ``confirm`` steps down from it and the check starts again there).

    Below a failure the search aims where the bytes it was over (the allocation that failed and
    the reserved memory it met, less the capacity) are saved at the step's bytes per unit,
    measured by the answer's own trial (:func:`_aimed_below`); where that aim is no nearer than
    a size already passed, it bisects. Measured on an H200 (an LSTM language model, 8 GiB cap):
    as a plain callable every size from 59 to 52 failed in this layout (1165 MiB over at 59, 110
    at 52) and 51 passed; a unit at a time that took 18 trials (2.1 s), and a line through two
    failures' excesses aimed at 17 where the excess fell unevenly (66: 1268, 65: 1121, 57: 934).
    It stops within a percent (a unit below 100 units), as the bisection in the trials' own layout
    does: a convolutional VAE's plain callable walked 1528 down to 1437 in ten trials (3.4 s, an
    H200), the last four inside a percent.

    Why: a hand loop's ``TrainStep`` (a ``transformers.Trainer``'s loop) gets its state back
    dropped by the probe's restore, so training makes it afresh, and the wall moves with the
    layout. Measured on an H200 (GPT-2 small in a ``Trainer``, bf16, 12 GiB cap,
    ``scripts/bench_transformers.py``): 6 passed its settle trial in the resumed layout, and a
    new trainer's loop at 6 ran out of memory at its second step in 2 of 3 runs, asking for the
    1.15 GiB of the logits' float copy."""
    per_unit = _bytes_per_unit(runner, units, multiple_of)
    lo = hi = None
    guess, over = units, None
    while True:
        record = runner.run(guess * multiple_of, "fresh", settle=True, layout=layout)
        if record.passed:
            lo = guess
        else:
            hi, over = guess, record.over_bytes
        if lo is not None and (hi is None or hi - lo <= max(1, hi // 100)):  # a percent, as _bisect_up
            break
        aim = _aimed_below(hi, over, per_unit)
        if lo is None:
            guess = aim if aim is not None else hi - step_down(record, hi)
            if guess < 1:
                return None
        else:
            guess = aim if aim is not None and lo < aim < hi else (lo + hi) // 2
    if lo == units:  # passed in both layouts at once
        return units
    record = runner.run(lo * multiple_of, "confirm", settle=True)  # the trials' own layout too
    if record.passed:
        return lo
    below = confirm(lo - step_down(record, lo)) if lo > 1 else None
    return None if below is None else in_fresh_layout(runner, below, multiple_of, layout, confirm)


def _bytes_per_unit(runner: TrialRunner, units: int, multiple_of: int) -> float | None:
    """The steady step's allocated bytes per unit at the passing size ``units`` (intercept
    included: an upper bound, so a step priced by it may fall short), None where no passing
    trial there measured a steady step."""
    record = next((r for r in reversed(runner.records) if r.batch_size == units * multiple_of and r.passed
                   and r.step_peak_bytes is not None and r.resident_bytes is not None), None)
    if record is None or record.step_peak_bytes <= record.resident_bytes:
        return None
    return (record.step_peak_bytes - record.resident_bytes) / units


def _aimed_below(failed: int, over: int | None, per_unit: float | None) -> int | None:
    """The size below ``failed`` that saves the ``over`` bytes it measured at ``per_unit``, at
    least one unit below; None where either is unknown, or below 1 there is nothing (an aim of 1
    below a failed 1 tried 1 again, for ever)."""
    if failed <= 1 or not over or over <= 0 or not per_unit:
        return None
    return max(1, failed - max(1, math.ceil(over / per_unit)))
