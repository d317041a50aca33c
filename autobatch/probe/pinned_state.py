"""Optimizer state an earlier trial created, pinning the segments a larger size needs.

Most optimizers create their state in their first step, and a probe keeps it from trial to
trial (creating it again costs the step's time). It lands in the segments that step's
activations had just freed, and a segment holding a live block cannot be returned to the
driver. When it was created at a size near the one now tried, those segments are the ones
this size's activations need, only too small: on an H200 (Llama-style decoder, 8 GiB cap)
AdamW's moments created by the trial at 4 pinned a 786 MiB segment with 165-197 MiB free in
it, and the trial at 5 ran out of memory with 0.66-0.82 GiB held in pieces too small, in the
CLI's process and in every process without a warm-up (``scripts/diag_wall_segments.py``),
while a new process that trains at 5 from its first step trained 200 steps every time.

So a settle trial (a size that may be the answer) that ran out of memory *at the allocator's
wall* (what was allocated plus the request stayed under the limit), with state created at
least half its size, and whose peak the passing sizes put under the limit (:func:`fits`),
runs once more after :meth:`PinnedState.drop_if_pinning` (its first step then
creates the state where training's first step in a new process does). Only then: dropping
the state before every settle trial, measured on the same H200, moved ResNet-50's answers
down (181 -> 180 as a ``TrainStep`` and 180 -> 178 as a plain callable, one probe each; with
cuDNN autotuning the plain callable 178 -> 176 in 4 of 4 probes) and made the autotuned probes
slower than Accelerate's (medians 8.6 and 7.7 s against 7.5 s), since state made among a
step's activations leaves the allocator flushing at the wall. State made at a far smaller
size (a first trial at 8 against answers near 100 or 180) is kept: ResNet-50 trains as the
probe found it. ViT-B/16 as a plain callable does not: beside AdamW's moments made at 8, its
101 and 100 fail at the wall and it answers 99, where new processes train 101. Dropping such
state too, at a failure at the wall, made that answer 101 on the same H200, but the trials
that followed walked up to 102 and confirmed 101 again, and a ``TrainStep``'s trials after
the drop ran three steps before failing where they had failed in one: 0.3-0.4 s more a probe,
level with Accelerate's instead of below it (``docs/promise-log.md``, "Tried and not kept").

The trial run again leaves its state among its activations, in split pieces the steady steps
reuse (1.70 GiB of them for the Llama decoder at 5, which then trained 200 steps with none of
the CLI's recoveries); the allocator's wall rule bounds such pieces by the step's own reserved
peak (:func:`~autobatch.probe.settling.wall_excess`). A trial run again that fails again costs
its steps. GPT-2 small (answer 5) ran two such: its trial at 7 failed at the wall and ran
again, although the passing 4 and 6 put 7's peak 1.1 GiB past the limit (no layout trains
it), and so did its confirmation at 6. Medians of two probes each, one H200 call: the code
before this module 0.87 s as a ``TrainStep`` and 0.91 s as a plain callable, with 7 run again
1.24 s and 1.11 s, against Accelerate's 1.49-1.50 s; with both run again, in an earlier call,
1.40 s and 1.37 s against 1.34 s. :func:`fits` keeps a size the passing sizes put past the
limit from running again (its effect on a GPU not yet measured). Runs again only after a
first step that failed were tried and dropped: the CLI's Llama trial at 5 fails at a later
step, and answered 4 again.
"""

from __future__ import annotations

from ..memory.lazy_state import LazyStateWatch
from .searching.line import LinearFit

__all__ = ["PinnedState", "fits"]


class PinnedState:
    """The size whose trial created the optimizer state the trials hold, and dropping it."""

    def __init__(self, watch: LazyStateWatch) -> None:
        self.watch = watch
        self.made_at: int | None = None
        self._drops = watch.drops  # the watch's drops when ``made_at`` was seen

    def observe(self, batch_size: int) -> None:
        """After a trial at ``batch_size``: remember it if its steps created the state. State
        dropped since it was remembered (by a check in a new process's layout,
        :mod:`~autobatch.probe.fresh_layout`, whose first step makes it again at its own size) is
        forgotten first. Measured on an H200 (a convolutional VAE's ``TrainStep``, 8 GiB cap):
        with the size of the first trial (8) still remembered after the check made the state
        again at 1536, the confirmation of 1535 and every size down to 1307 ran out of memory
        at the wall beside it and none ran again without it: the probe answered 1216 where new
        processes train 1522."""
        if self.made_at is not None and self.watch.drops != self._drops:
            self.made_at = None
        if self.made_at is None and self.watch.has_created():
            self.made_at, self._drops = batch_size, self.watch.drops

    def drop_if_pinning(self, batch_size: int) -> bool:
        """Drop the state the trials created if it may pin segments a trial at ``batch_size``
        needs (it was created at least half that size); whether it did. The next step creates
        it again."""
        if self.made_at is None or 2 * self.made_at < batch_size:
            return False
        self.watch.drop_created()
        self.made_at = None
        return True


def fits(batch_size: int, peaks: dict[int, int | None], limit: int | None) -> bool:
    """Whether the steady peaks of the passing sizes (``peaks``: size -> allocated peak) put
    ``batch_size``'s under ``limit``: the smallest peak of a passing size at least as large
    bounds it; else the line through the two largest passing sizes below it, or through the
    origin and the one there is (which errs high, the model's own bytes scaled too). True
    where nothing is known."""
    if limit is None:
        return True
    known = {b: peak for b, peak in peaks.items() if peak is not None}
    at_least = [peak for b, peak in known.items() if b >= batch_size]
    if at_least:
        return min(at_least) <= limit
    below = sorted(known.items())
    if not below:
        return True
    line = LinearFit.through([below[-2] if len(below) > 1 else (0, 0), below[-1]])
    return line.predict(batch_size) <= limit
