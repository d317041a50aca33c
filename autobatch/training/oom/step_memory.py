"""The runner's measured memory line: which micro-batch fits now, from the steps it ran.

After an out-of-memory error the runner needs the next micro-batch. Halving throws away what
it knows: every step it trained measured its own allocated peak above the memory that was
resident when it began (weights, optimizer state, anything else alive). Those points give a
line, ``peak - resident = intercept + slope * micro_batch``; with what is resident *now*
(after the failed attempt was freed, including whatever squeezed the run: another tensor, a
neighbour's cache) and the capacity less the allocator's headroom, the line says the largest
micro-batch that fits. The failed attempt says something too: the memory it held when the
OOM was caught (:meth:`StepMemory.caught`, before its tensors were freed) plus the allocation
that failed, or its peak where that is more, is a lower bound of what ``micro_batch`` needs.
(Its peak *plus* the allocation was not one: a step that peaked in one micro-batch's forward and
failed in the next one's backward was charged both; two pieces of 1818 a few percent over a
simulated 2 MiB went to 1488 where 1802 fit, now to 1762.) Where that
still fits but the allocator's *reserved* peak plus the request did not (blocks held but too
split to serve it: measured on an H200, a ResNet-50 step at 7.86 of 8 GiB allocated failed to
find 36 MiB in 122 MiB of reserved-but-free memory), the reserved figures size the step down.

:meth:`StepMemory.after_oom` combines both. It returns None (the caller halves) when nothing
is known: no instrument (a CPU run outside :func:`~autobatch.simulated_memory`), no measured
step and no figure in the error, or an OOM the figures do not explain (the line says the
size fits and the failed attempt stayed under the capacity: an injected fault, or a
one-off the figures cannot size). One measured point gives a line through the origin, whose
slope overestimates the per-sample cost (the intercept's bytes are charged per sample), so
the answer errs small.

The failed attempt's lower bound is exact only where it failed near its natural peak (a squeeze:
the line, with what is resident now, already says the size no longer fits). Where the line says
the size fits and the attempt still needed more than the room, *this batch* costs more per
sample than the steps the line was measured on (a 128-token batch in a run sized on 16-token
ones): the attempt failed early, its lower bound is little above the room, and sized on it alone
the replays crept down (32, 29, 14, 10, 7, 6, 5: six replays of one step). Two rules bound
that. A pick that fails again in the same step (``after_oom(previous=)``) steps down at
least twice as far as the pick that proved too optimistic did (or to half, where that is less),
so the replays of a step are logarithmic in how wrong the line was; and a step with a failure
the line does not explain is an ``outlier``: its point is not added to the line (it would tilt the line of the run's ordinary
batches, and size their grow-back and later recoveries by it), and the runner tries the size
before it again at the next step (:mod:`autobatch.training.oom.growth`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...memory.devices import AcceleratorMemory, DeviceMemory, SimulatedDeviceMemory
from ...memory.oom import requested_bytes
from ...memory.simulated import active_simulation
from ...probe.searching.search import peak_limit

__all__ = ["StepMemory"]

#: points kept per micro-batch size (the newest wins); sizes kept in all
_MAX_SIZES = 8


class StepMemory:
    """Per-step allocated peaks of the runner's steps and the micro-batch they imply.

    :meth:`begin` before every attempt, :meth:`record` after a step that passed,
    :meth:`after_oom` at the top of a replay, :meth:`fitting` for the largest micro-batch the
    line says fits now. Off (every answer None) where the device has no memory instrument.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.points: dict[int, int] = {}  # micro-batch -> step peak above the resident memory
        self.last_peak: int | None = None  # the last passing step's allocated peak, in bytes
        self.max_peak: int | None = None  # the largest passing step's (a short last batch is not the next one)
        self._resident = 0
        self._at_failure: int | None = None  # allocated when the attempt's own OOM was caught (None: unknown)
        self._memory: DeviceMemory | None = None
        self.outlier = False  # this step needed more than the line says for its size (reset by step_started)

    def instrument(self) -> DeviceMemory | None:
        """The device's memory instrument now (the simulated budget is looked up per step)."""
        if self.device.type == "cpu":
            simulation = active_simulation()
            return None if simulation is None else SimulatedDeviceMemory(simulation)
        if self.device.type == "cuda" and torch.cuda.is_available():
            return AcceleratorMemory(self.device)
        return None

    def begin(self) -> None:
        """An attempt starts: remember what is resident, start a fresh peak."""
        self._memory = self.instrument()
        self._at_failure = None
        if self._memory is not None:
            self._resident = self._memory.allocated()
            self._memory.reset_peak()

    def caught(self) -> None:
        """This attempt's own OOM was just caught, its tensors still alive (the traceback holds
        them): what it held then bounds what it needed, with the allocation that failed."""
        if self._memory is not None:
            self._at_failure = self._memory.allocated()

    def step_started(self) -> None:
        """A global step starts: no failure of it is known yet."""
        self.outlier = False

    def record(self, micro_batch: int) -> None:
        """A step at ``micro_batch`` (its largest micro-batch) passed: add its point, unless the
        step was an ``outlier`` (its peaks still count for :meth:`spare_after`)."""
        if self._memory is None:
            return
        self.last_peak = self._memory.peak()
        self.max_peak = max(self.max_peak or 0, self.last_peak)
        if self.outlier:
            return
        self.points.pop(micro_batch, None)
        self.points[micro_batch] = max(0, self.last_peak - self._resident)
        while len(self.points) > _MAX_SIZES:
            self.points.pop(next(iter(self.points)))

    def line(self) -> tuple[float, float] | None:
        """``(intercept, slope)`` of peak-above-resident against micro-batch, or None."""
        if not self.points:
            return None
        sizes = sorted(self.points)
        if len(sizes) == 1:
            return 0.0, self.points[sizes[0]] / sizes[0]
        low, high = sizes[0], sizes[-1]
        slope = (self.points[high] - self.points[low]) / (high - low)
        if slope <= 0:  # noise or a peak that does not grow: charge every byte per sample
            return 0.0, max(self.points[s] / s for s in sizes)
        return max(0.0, self.points[high] - slope * high), slope

    def _room(self, memory: DeviceMemory) -> int:
        capacity = memory.capacity()
        limit = peak_limit(memory, capacity)
        return (capacity if limit is None else limit) - memory.allocated()

    def spare_after(self, extra: int) -> float | None:
        """The share of the device's capacity the largest passing step would have left free
        with ``extra`` more bytes resident (None: no step measured yet, or no instrument). The
        largest, not the last: after a short batch (an epoch's ragged last one, short
        sequences) the last step's peak says nothing of the next full one, which then ran out
        of memory beside a step guard moved to the device."""
        memory = self.instrument()
        if memory is None or self.max_peak is None:
            return None
        capacity = memory.capacity()
        if not capacity:
            return None
        return (capacity - self.max_peak - extra) / capacity

    def fitting(self) -> int | None:
        """The largest micro-batch the line says fits with what is resident now (None: unknown)."""
        memory, line = self.instrument(), self.line()
        if memory is None or line is None or line[1] <= 0:
            return None
        return max(0, math.floor((self._room(memory) - line[0]) / line[1]))

    def after_oom(self, micro_batch: int, error: str, previous: int | None = None) -> int | None:
        """The next micro-batch after ``micro_batch`` failed with ``error`` (memory already
        freed), or None when the figures do not explain the failure (the caller halves).

        ``previous``: the size that failed before it in the same step, where this one was picked
        from measurements. Where the step is an ``outlier`` (the line said its sizes fit: its figures
        are not this batch's), that pick proved ``previous - micro_batch`` too optimistic, so the
        answer is at most ``micro_batch - 2 * (previous - micro_batch)``, or half of ``micro_batch``
        where that is more (a step's replays stay logarithmic in how far off the line was). Elsewhere
        a pick is sized by its own figures: on an H100 a CLI run started at twice the probed 1304
        failed at 2608, then at its measured 1330 (no line yet), and the cap took it to 652 where
        the figures said about 1300."""
        memory = self._memory if self._memory is not None else self.instrument()
        if memory is None:
            return None
        guesses: list[int] = []
        fits = self.fitting()
        if fits is not None and fits < micro_batch:
            guesses.append(fits)  # the line: what is resident now leaves no room for micro_batch
        requested = requested_bytes(error)
        if requested is not None:
            before = memory.peak() if self._at_failure is None else max(memory.peak() - requested, self._at_failure)
            needed = before + requested - self._resident  # a lower bound of micro_batch's need
            room = self._room(memory)
            if needed > room > 0:
                guesses.append(math.floor(micro_batch * room / needed))
                # the line says micro_batch fits with what is resident now: this batch costs more than its steps
                self.outlier = self.outlier or (fits is not None and fits >= micro_batch)
            # fragmentation: the allocated figures leave room, but the allocator's reserved memory
            # was at the capacity (blocks held but too split to serve the request)
            held = memory.peak_reserved() + requested - self._resident
            reachable = memory.capacity() - memory.allocated()
            if held > reachable > 0 and not (needed > room):
                guesses.append(math.floor(micro_batch * reachable / held))
        if not guesses:
            return None
        # at least a small step down, so a line that is slightly off cannot replay forever
        pick = min(min(guesses), micro_batch - max(1, micro_batch // 32))
        if previous is not None and previous > micro_batch and self.outlier:  # the line is wrong for this batch
            pick = min(pick, max(micro_batch - 2 * (previous - micro_batch), micro_batch // 2))
        return max(1, pick)

    def state(self) -> dict[str, Any]:
        return {"points": dict(self.points)}
