"""What ``auto``'s estimate may cost in time: its first trace against a real step of the search.

The operator budget (:mod:`~autobatch.probe.tracing.trace_budget`) stops traces whose operators grow
with the batch; a step whose operators are many at every batch size costs as much per trace at 16
samples as at the boundary. PyTorch's fake ``GRU`` runs one time step at a time (some 12,000
operators for a 2-layer GRU of 20 steps, two steps traced), so each trace cost 1.5-3 s on the CPU
where a real step at that size took 20 ms: ``auto``'s estimate took longer than the whole search
without it (9.2 s against 1.8 s). So where the first trace took more than :data:`FLOOR_S`, the
search's own first trial (the size ``auto`` starts from without an estimate, which it would run
anyway) is run, and where the trace cost more than :data:`RATIO` such trials the estimate stops,
the search starting from that trial, with a note saying why. Where tracing stays the cheaper, the
first size is traced again: the trial made the optimizer's lazy state (Adam's moments), which the
later traces see, and the line through them must have it at both ends (the estimate then leaves out
that state, which the simulated budget counts: a 12-layer transformer's placed its first trial at 44
where 41 fits; the search, exact either way, went on from there).
"""

from __future__ import annotations

import time
from typing import Callable

from .estimate_records import EstimateError, MemoryEstimate

__all__ = ["TraceCost", "FLOOR_S", "RATIO"]

#: A first trace quicker than this many seconds is not weighed (no trial runs for it): the rest of
#: the estimate costs about two more such traces, which no probe notices. 1 s, not less: on a busy
#: 2-core machine the default command-line job's first trace passed 0.5 s, weighing it ran one more
#: trial (8 samples, 3.7 s with the first step's costs), and the probe took 9.3 s where it took 7.8 s
#: unweighed (its two traces 0.95 s in all); a 2-layer GRU's first trace takes 1.5-3 s
FLOOR_S = 1.0
#: The estimate stops where its first trace cost more than this many trials at the search's first
#: size (the trial's seconds, all its steps). Once that trial ran, the rest of the estimate costs two
#: traces or more like the first (that size again, and 256) and spares about one trial of the search
#: (its leap from the first trial towards the boundary), which at a larger batch costs a few first
#: trials where the step's cost grows with its batch, one where it does not. CPU, first trial at 8
#: (3 steps), one thread: a 2-layer GRU's trace cost 10 such trials; a 2-layer transformer's, 6; a
#: 12-layer transformer's (d_model 256), about 2, and with the estimate its probe took 27 s where
#: trials alone took 16 s; a small CNN's or MLP's trace takes under 0.5 s and is not weighed
RATIO = 2


class TraceCost:
    """Times the first trace and weighs it against ``trial()``: the size of the search's first trial
    and its seconds (it runs that trial), or None where it ran out of memory."""

    def __init__(self, trial: Callable[[], tuple[int, float | None]],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.trial, self.clock = trial, clock

    def first(self, trace: Callable[[], MemoryEstimate]) -> MemoryEstimate:
        """The first trace, run again after the trial where tracing stays the cheaper; raises
        :class:`EstimateError` (saying why) where the trial was the cheaper."""
        began = self.clock()
        estimate = trace()
        seconds = self.clock() - began
        if seconds <= FLOOR_S:
            return estimate
        size, real = self.trial()  # a trial's own error (not out of memory) is raised as the search's would be
        if real is None:
            raise EstimateError(f"the search's first trial, batch {size}, ran out of memory: the boundary lies below "
                                f"it, and the first trace took {seconds:.2f} s")
        if seconds > RATIO * real:
            raise EstimateError(
                f"a fake-tensor trace of the step took {seconds:.2f} s, {seconds / max(real, 1e-9):.0f} times the "
                f"search's first trial (batch {size}, {real:.2f} s; a trace runs each operator about ten times slower "
                f"than the step, and a recurrent layer's fake version one time step at a time), so the estimate "
                f"would cost more than the trials it spares")
        return trace()  # the trial made the optimizer's state: the later traces see it, so this one must too
