"""Out-of-memory errors a probed step caught itself: its trial fails, as the step ran out of memory.

A plain callable often wraps its step in the user's own retry (``try: ... except
torch.OutOfMemoryError: return False``, a per-batch ``except`` that skips the batch). The error
never reaches the trial, which saw the call return and counted the size as one that trains:
every size "passed" and the search climbed to its ceiling (16777216 samples on the CPU's
simulated device, with a 4 MiB budget), an answer no step ever trained at.

Where the device counts its out-of-memory errors (a simulated budget's ``oom_count``, CUDA's
``num_ooms``: :func:`~autobatch.memory.diagnostics.oom_count`), a trial whose calls returned
after the device raised errors that no handler recognised (:func:`~autobatch.memory.oom.recognised_ooms`:
autobatch's own handlers, a nested decorated call's retries, the user's ``is_oom_error`` check)
fails as out of memory, its error naming the callable and what to change. The answer stays a size
whose steps raised none. The errors are then counted as recognised, so an enclosing
``find_executable_batch_size`` call does not warn of them again. Where the device counts none
(the CPU outside a simulated budget) nothing changes. On an accelerator a library may catch such
an error and carry on (cuDNN's plan search, :class:`CaughtWatch`), so there only a trial whose
every step after its first raised one fails.
"""

from __future__ import annotations

import functools

from ..memory.devices import DeviceMemory, SimulatedDeviceMemory
from ..memory.diagnostics import caught_between, oom_mark
from ..memory.oom import recognised_ooms
from .held_growth import HeldGrowth

__all__ = ["CAUGHT", "CaughtWatch", "caught_error", "caught_note", "step_name"]

#: how the error of a trial whose step caught its own out-of-memory errors begins
CAUGHT = "out of memory, caught inside the step: "


class CaughtWatch:
    """Counts, step by step, the out-of-memory errors the device raised that no handler recognised.

    On the CPU's simulated device every such error is the step's own catch: each counts. On an
    accelerator a library may catch one and carry on correctly: cuDNN, for a new shape's first
    step, tries its convolution plans in turn and passes over one whose workspace does not fit
    (``try_plans`` catches the allocator's error in C++, which ``num_ooms`` counts), and again
    where a cached plan's workspace no longer fits, after which the plan it found instead is
    cached. So there only a trial whose every step after its first raised one counts (a user's
    wrapper catches its error at every step of one size; a one-step trial cannot tell, and the
    answer's full trial then does). Where the device counts none, nothing is counted."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory, self.strict = memory, isinstance(memory, SimulatedDeviceMemory)
        self._mark = oom_mark(memory)
        self.per_step: list[int] = []

    def step_done(self) -> None:
        """After a step that returned: the errors it raised that no handler recognised."""
        now = oom_mark(self.memory) if self._mark is not None else None
        if now is not None:
            self.per_step.append(caught_between(self._mark, now))
            self._mark = now

    def caught(self) -> int:
        """The errors the trial's steps caught themselves, by the rule above (0: none, or a library's),
        counted as recognised: an enclosing decorated call does not warn of them again."""
        later = self.per_step[1:]
        count = sum(self.per_step) if self.strict else sum(later) if later and all(later) else 0
        if count:
            recognised_ooms(count)
        return count


def step_name(fn: object) -> str:
    """How to name the user's callable in a message: a function's or a bound method's qualified
    name, a ``functools.partial``'s function, a callable object's class."""
    fn = fn.fn if isinstance(fn, HeldGrowth) else fn  # the trial's wrapper
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(fn).__qualname__} object"


def caught_error(count: int, batch_size: int, fn: object) -> str:
    """The error of a trial of ``batch_size`` whose step ``fn`` caught ``count`` out-of-memory errors itself."""
    errors = "an out-of-memory error" if count == 1 else f"{count} out-of-memory errors"
    return (f"{CAUGHT}{step_name(fn)} returned at batch {batch_size} after catching "
            f"{errors} itself (a try/except around its step: a retry, a skipped batch), so the trial counts as out of "
            "memory. Let them leave the function (except Exception as exc: if autobatch.is_oom_error(exc): raise) so "
            "the probe sees them, or remove the wrapper while probing")


def caught_note(records: list) -> str | None:
    """The result's note where trials (:class:`~autobatch.probe.records.TrialRecord`) failed for errors their
    step caught itself: the first such error, and the sizes (None where none did)."""
    caught = [r for r in records if not r.passed and (r.error or "").startswith(CAUGHT)]
    if not caught:
        return None
    sizes = ", ".join(str(b) for b in sorted({r.batch_size for r in caught}))
    return f"trials at batch {sizes} failed: {caught[0].error[len(CAUGHT):]}"
