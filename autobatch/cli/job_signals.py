"""A sweep job's SIGTERM outside training stops the job as a Ctrl-C does.

Hydra's basic launcher runs a sweep's jobs in its own process. A SIGTERM (a scheduler's, a
``kill``) while a job probed had the default action: the process ended where it was, the job
wrote no row, and the sweep's summary listed the jobs before it alone ("1 job, 0 failed"), where
a Ctrl-C leaves an ``interrupted`` row (:func:`autobatch.cli.sweep.record_interrupted`).
:func:`terminate_as_interrupt` raises :class:`Terminated`, a ``KeyboardInterrupt``, instead, so
the row says ``interrupted (SIGTERM)`` and the command exits 143 (:func:`exit_code`). Training
puts its own handlers over it (:class:`autobatch.cli.interrupt.Interrupts`, which saves a
checkpoint first). A handler set by someone else (a launcher's, submitit's) and an ignored
signal are left alone, and only the main thread can set one.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["Terminated", "terminate_as_interrupt", "signal_name", "exit_code"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the job was."""


def signal_name(exc: BaseException) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


def exit_code(exc: BaseException) -> int:
    """128 + the signal's number: 143 for SIGTERM, 130 for a Ctrl-C."""
    return 143 if isinstance(exc, Terminated) else 130


def _raise(signum: int, frame: Any) -> None:
    raise Terminated


@contextmanager
def terminate_as_interrupt(enabled: bool = True) -> Iterator[None]:
    """While entered, SIGTERM raises :class:`Terminated` (where ``enabled``, in the main thread,
    and where SIGTERM has its default action); the handler before is put back after."""
    if (not enabled or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
