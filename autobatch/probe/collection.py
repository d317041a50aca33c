"""How much garbage collection a failed trial's clean-up makes: the young generations, and a
full collection only where they left memory held.

Measured on this repository's CPU host (``/tmp/p27/gccost.py`` in review 27): ``gc.collect(1)``
costs < 0.1 ms, ``gc.collect(2)`` 62 ms in a process that imported torch alone and 234 ms with
transformers, accelerate and lightning imported and a million small objects alive (~0.12 s on an
H200 host). A failed step's frames and traceback, and the cycles they close, were made when the
error was raised: the young generations hold them.
"""

from __future__ import annotations

from typing import Callable

from ..memory.oom import free_memory

__all__ = ["LIVE_SLACK", "Leftover", "collect_failed_step"]

LIVE_SLACK = 2**20  # held past the optimizers' state without a full collection: library buffers (H200 LSTM: < 1 MiB)


def collect_failed_step(allocated: Callable[[], int], kept: int, *, full_if_held: bool) -> None:
    """Collect what a failed trial left above ``kept`` bytes (its starting level plus live state
    it grew): the young generations, then, with ``full_if_held``, a full collection only if
    ``allocated()`` is still above ``kept``.

    ``full_if_held`` is for rank agreement, where no later trial retries beside older garbage
    (:meth:`~autobatch.probe.trial.TrialRunner._garbage_was_in_the_way` needs one rank's own
    choice): there every failure used to make a full collection (62-234 ms a failed trial, above);
    one that the young generations already brought back to ``kept`` could free only garbage older
    than the trial, which sat inside its starting level and was never collected when the failure
    left nothing held at all. Each call of :func:`~autobatch.memory.oom.free_memory` also drains
    the autograd queue and empties the accelerator's cache."""
    free_memory(generation=1)
    if full_if_held and allocated() > kept:
        free_memory()


class Leftover:
    """Memory failed trials left held past a quick collection, for one runner
    (:class:`~autobatch.probe.trial.TrialRunner`): whether a trial that fails beside it runs again
    after a full collection (:meth:`in_the_way`), and whether the last full collection freed any."""

    def __init__(self) -> None:
        self.held = False  # a failed trial left memory held that a quick collection did not free
        self.full_frees: bool | None = None  # what the last full collection did

    def after_failure(self, allocated: Callable[[], int], kept: int, *, full_if_held: bool) -> None:
        """:func:`collect_failed_step`, then whether more than :data:`LIVE_SLACK` stays held above ``kept``."""
        collect_failed_step(allocated, kept, full_if_held=full_if_held)
        self.held = self.held or allocated() > kept + LIVE_SLACK  # live state or older garbage

    def in_the_way(self, allocated: Callable[[], int], after_oom: Callable[[], None] | None) -> bool:
        """Whether a trial that just failed should run again: an earlier failed trial left memory
        held, and a full garbage collection now frees some of it (old cycles holding tensors, e.g.
        of a model built inside a plain callable), so this failure may be theirs. Once a full
        collection freed nothing, the leftover is live state and none runs again."""
        if not self.held or self.full_frees is False:
            return False
        self.held = False
        if after_oom is not None:
            after_oom()
        free_memory(generation=1)  # this failure's own garbage first, so it is not counted
        before = allocated()
        free_memory()
        self.full_frees = allocated() < before
        return self.full_frees
