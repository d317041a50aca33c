"""When the answer's trial has settled: what the caching allocator does after a few steps.

A size that passes three steps can still fail later, because the caching allocator's state
keeps changing after the first steps (issue 16). The answer's confirming trial (a *settle*
trial, :meth:`~autobatch.probe.trial.TrialRunner.run`) keeps stepping, up to
:func:`most_steps`, while either sign of an unsettled allocator shows, and must end clear of
its wall:

* **Reserved memory still grows** (:func:`growing`): fragmentation that shows only after a
  few steps.
* **The allocator still flushes its cache** (:class:`FlushCount`; every settle trial, whoever
  trains the answer): a request it could not serve from its cached blocks
  made it return them all to the driver and ask again (``num_alloc_retries``). With autotuned
  workspaces, which fill the memory free when the autotuner ran, a step that has to do this
  every time trains only while the pieces happen to fall right. Measured on an H200 (ResNet-50 with cuDNN autotuning, 8 GiB
  cap, a hand loop in new processes, ``scripts/bench_promise.py --child``): at 180, 4 of 6 runs
  ran out of memory at step 5-25 asking for 2 MiB with ~0.8 GiB reserved but unallocated,
  after 19-62 retries (several a step); at 179, 2 of 4 at step 23; at 178, 0 of 3; and at the
  probe's answer, 177, 0 of 4. Untuned, plans that flushed at ResNet-50's 180 trained 200 steps
  in a new process from scratch (a resumed one did not: below). Each flush frees and
  re-maps device memory and synchronizes, so it costs speed too. With expandable segments
  (autotuned or not) a flush unmaps the free pages and maps them where the request fits, so a
  step that flushes every time sits at the cap and trains only while the partly used pages
  leave room. Measured on an H200 (8 GiB cap, the library under ``expandable_segments:True``,
  ``scripts/bench_promise.py``): the answers whose trials flushed at every step ran out of
  memory in training (ViT-B/16 at 103: a hand loop at step 10 in the probing process and at
  step 15 in a new one, the Runner at step 93; ResNet-50 at 182 as a plain callable, its
  reserved peak at the cap: a hand loop at step 24 in a new process); those whose trials did
  not flush trained 200 steps in both (ResNet-50's ``TrainStep`` at 183, GPT-2 at 6). A hand
  loop (a plain callable's) under fixed segments, untuned: a new process that makes its
  optimizer state in its first step trains at a size whose steps flush, but a run resumed from
  a checkpoint, whose state exists before its first step, does not. Measured on an H200 (8 GiB
  cap, ``scripts/bench_promise.py --exact-fresh --resumed``): ResNet-50's plain answer, 180, its
  trial flushing at every step, trained 200 steps from scratch and ran out of memory at step 4
  resumed; 179 at step 6; 178 trained both ways. A ``TrainStep``'s Runner replays a step that
  runs out of memory, but the answer must train without that: ResNet-101's ``TrainStep`` (H200,
  8 GiB cap) passed 120 with every step flushing, and the Runner at 120 ran out of memory at its
  step 2-5 in the probing process, a new one and a resumed one; settled, the trial answers 119,
  which trained 200 steps in all three (ResNet-50's 181 stops flushing by its third step).
* **The steady step clears the allocator's wall** (:func:`wall_excess`): its allocated peak
  plus the split pieces it left leave room for a request.
"""

from __future__ import annotations

import math

from ..memory.devices import DeviceMemory

__all__ = ["step_down", "WALL_BYTES", "SETTLE_FACTOR", "TUNED_SETTLE_FACTOR", "FLUSHING_WHY", "FlushCount", "flushing_error", "growing",
           "most_steps", "reserved_bound", "split_bytes", "wall_excess"]

#: the allocator's smallest large block: room for nothing less
WALL_BYTES = 2 * 2**20
#: a settle trial's most steps, in multiples of its own
SETTLE_FACTOR = 2
#: the same for a trial whose first step autotuned
TUNED_SETTLE_FACTOR = 4


def most_steps(steps: int, tuned: bool) -> int:
    """How many steps a settle trial may run while its allocator has not settled.

    Twice its steps; four times where its first step autotuned. cuDNN's search for each new
    convolution empties the allocator's cache (PyTorch does so after every search) and tries
    workspaces that do not fit, so the allocator starts the steady steps further from its
    settled state, and flushing takes longer to stop at any size. Measured on an H200
    (ResNet-50 with cuDNN autotuning, 8 GiB cap, a hand loop in new processes,
    ``scripts/diag_cudnn_cache.py --cases det --keep-input``, two runs a size): after the tuned
    first step the allocator flushed through step 6-8 in six of eight runs, at 174 and 176 (which
    train) as at 178 (which trained 200 steps in 5 of 5 new processes); a tuned confirmation cut off at six steps
    failed 178 in 2 of 3 probes and paid a second autotuning pass (3.7-8.7 s) for 177, where
    with four times its steps it passed 178 at its twelfth step in 3 of 3 probes. At 179
    and 180, which failed in 2 of 4 and 4 of 6 new processes, the flushing went on (out of
    memory at steps 5-25 after 19-62 retries), and the untuned trials before the confirmation
    already fail them at twice their steps."""
    return steps * (TUNED_SETTLE_FACTOR if tuned else SETTLE_FACTOR)


class FlushCount:
    """The allocator's retry counter read before a trial's first step and after each step.

    ``flushes``: the steps after the first (which autotunes and creates the optimizer's lazy
    state) during which the counter rose; None where the device does not count retries.
    ``flushing``: the last of those steps did."""

    def __init__(self) -> None:
        self.readings: list[int] = []

    def read(self, retries: int | None) -> None:
        if retries is not None:
            self.readings.append(retries)

    @property
    def flushes(self) -> int | None:
        if not self.readings:
            return None
        return sum(b > a for a, b in zip(self.readings[1:], self.readings[2:]))

    @property
    def flushing(self) -> bool:
        return len(self.readings) >= 3 and self.readings[-1] > self.readings[-2]


#: why a settle trial still flushing fails, by what makes flushing matter (:func:`flushing_error`)
FLUSHING_WHY = {
    "expandable": "with expandable segments such a step is at the cap, and trains only while the partly used pages "
                  "leave room",
    "autotuned": "with cuDNN autotuning, whose workspaces fill the memory free when it tunes, such a size trains only "
                 "while the pieces happen to fall right",
    "hand_loop": "a hand loop cannot replay a step, and a run resumed from a checkpoint (its optimizer state made before "
                 "the first step) runs out of memory at such a size",
    "replay": "such a size trains only while the pieces happen to fall right, and the answer must train without a "
              "replay of a step that runs out of memory (autobatch's Runner replays one, at a cost)",
}


def flushing_error(flushes: int | None, steps: int, why: str) -> str:
    """Why a settle trial whose last step still flushed the allocator's cache fails; ``why`` is
    a key of :data:`FLUSHING_WHY`."""
    return (f"at the allocator's wall: its last step still made the caching allocator return its cache to the "
            f"driver to serve a request ({flushes} of {steps - 1} steps after the first did); {FLUSHING_WHY[why]}")


def growing(step_reserved: list[int]) -> bool:
    """Whether the last step reserved more than the one before (the allocator not settled)."""
    return len(step_reserved) >= 2 and step_reserved[-1] > step_reserved[-2]


def split_bytes(memory: DeviceMemory) -> int | None:
    """``memory.inactive_split()`` where the device reports it (CUDA), else None."""
    inactive_split = getattr(memory, "inactive_split", None)
    return None if inactive_split is None else inactive_split()


def wall_excess(step_peak: int, inactive_split: int, capacity: int, reserved_peak: int | None = None, *,
                margin: int = WALL_BYTES) -> int:
    """Bytes by which a steady step left no room for the free pieces the allocator cannot
    return (0: clear of the allocator's wall).

    The caching allocator serves a request from a cached free block or, failing that,
    returns its cached free segments to the driver and asks again. What it cannot return are
    the free pieces of segments that still hold a live tensor (inactive split blocks): a
    request fails once the allocated bytes, those pieces and the request pass the capacity.
    So the headroom a size needs above its allocated peak is what its steady steps leave in
    split pieces, measured at the end of the trial, not a fixed percentage. Measured on an
    H200 (8 GiB cap, ResNet-50 with cuDNN autotuning; issue 16): steady steps left
    0.08-0.18 GiB in split pieces at every size from 165 to 180; a step allocating 7.84 GiB
    (above 8 GiB less 0.18) passed 3-step trials and ran out of memory after 5-15 training
    steps, while 7.74 GiB trained 200.

    The pieces counted at the end of a step may be the very blocks its activations fill at
    its peak; then the sum counts them twice. ``reserved_peak`` (the step's own reserved
    peak, which holds its allocated peak and every piece it could not use at that moment)
    bounds that: a step whose reserved memory stayed a request short of the capacity, in a
    trial whose steady steps never flushed the cache, never met the wall, whatever it left
    split. Optimizer state created inside a step lands among
    that step's activations and leaves large split pieces the later steps reuse: on an H200
    (Llama-style decoder, 8 GiB cap) 1.0-1.7 GiB of them, at a size that trained 200 steps in
    every new process. ``margin``: the room the reserved peak must leave (a request's worth, or
    the headroom after a flush: :func:`reserved_bound`).
    """
    pieces = step_peak + inactive_split + WALL_BYTES - capacity
    if reserved_peak is not None:
        pieces = min(pieces, reserved_peak + margin - capacity)
    return max(0, pieces)


def reserved_bound(step_reserved: int | None, flushes: int | None, flushing: bool, expandable: bool,
                   headroom: int) -> tuple[int | None, int]:
    """The reserved peak that bounds :func:`wall_excess`'s figure (None: none), and the room it
    must leave, for a trial whose steps after the first flushed the cache ``flushes`` times, the
    last one too where ``flushing``.

    No flush: the last step's reserved peak, a request's worth short of the capacity. After a
    flush, under fixed segments, where the last step did not flush: that step was served from the
    segments it found, so its reserved peak bounds the pieces too, if it left the allocator's
    ``headroom`` (1 % of the capacity) for a later step whose pieces fall otherwise. The split
    pieces counted at the end of such a step are often the very blocks the next step's
    activations fill: on an H200 (8 GiB cap) a convolutional VAE's plain callable failed every
    size from 1528 down to 1438 as at the wall, 7-235 MiB over with 1.2 GiB of such pieces after
    one flushing step, where new processes train 1522 for 200 steps. Less room than the headroom
    is no bound: ResNet-50's 182 stayed 14 MiB below the cap in its last step after three
    flushing steps and ran out of memory at training step 8. Otherwise (the last step flushed,
    or expandable segments, whose pages a flush unmaps) none: a flush returns blocks, and the
    reserved peak no longer holds every piece."""
    if flushes == 0:
        return step_reserved, WALL_BYTES
    if flushes and not flushing and not expandable:
        return step_reserved, headroom
    return None, WALL_BYTES


def step_down(record, units: int) -> int:
    """How many units below a failed confirmation to try next: enough to save the bytes a
    trial that ran but came too close to the capacity measured it was over (at its own step's
    cost per unit), else a percent (the edge moved; an OOM trial has no steady step to price
    its shortfall by)."""
    percent = max(1, units // 100)
    over, peak, resident = record.over_bytes, record.step_peak_bytes, record.resident_bytes
    if not over or peak is None or resident is None or peak <= resident:
        return percent
    # the step's bytes per unit, intercept included, so this may fall a unit short: the next
    # confirmation then measures again
    per_unit = (peak - resident) / units
    return max(1, min(units - 1, math.ceil(over / per_unit))) if units > 1 else 1
