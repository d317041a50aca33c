"""Ending a run early on request: after a whole step, on every rank alike, with its checkpoint.

:meth:`Stoppable.request_stop` is how a caller ends :meth:`~autobatch.Runner.fit` before its
``epochs`` or ``steps`` are done without losing what it trained: early stopping from an
``on_step_end`` hook, a watchdog thread, or a signal handler (the command line's ``train``
under ``torchrun`` turns Ctrl-C and SIGTERM into one: :mod:`autobatch.cli.interrupt`). It only
sets a flag, so it is safe from a signal handler or another thread. ``fit`` checks it after
each applied step: the step in progress finishes (no update is half-applied, nothing is
undone), the checkpoint is written (with ``checkpoint_dir``), and ``fit`` returns with
``result.stopped`` (not when that step was the run's last anyway: the run is complete); a
resume goes on from the next batch.

Under ``torch.distributed`` a request on any rank travels on the next sync point to every rank
(:mod:`autobatch.dist.stopping`), and every rank ends after the same step: a step's own sync
points carry it, so it costs no collective. A request made before the step's last sync point
(its vote after the optimizer step) ends the run after that step, as in one process; one made
after it (in ``on_step_end``, say) after the next step. Stopping there on one rank alone would
leave its peers in a collective, and a checkpoint then (a collective too) could not be written.

A preempted job (SIGTERM from SLURM, Kubernetes or ``torchrun``, which kill it a grace period
later) saves too, without a handler of the user's: while :meth:`~autobatch.Runner.fit` runs
with a ``checkpoint_dir``, in the main thread, and nothing else handles SIGTERM
(:func:`saves_on_sigterm`), a SIGTERM asks for the stop above; once ``fit`` has written the
checkpoint, the signal is raised again with its default action, so the process still ends as
the signal asked (exit 143), only a step later and with its progress saved. An error out of
``fit`` after the signal (its checkpoint could not be written: a full disk) is logged with its
traceback first: the signal ends the process before Python could print it. A second SIGTERM
before that ends it at once. A handler of the user's (or of the command line, Lightning, a
launcher) is left alone, and so is Ctrl-C (``KeyboardInterrupt``).
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
from typing import Any, Callable

__all__ = ["Stoppable", "saves_on_sigterm"]

log = logging.getLogger("autobatch.runner")


class Stoppable:
    """The runner's stop request (a mixin of :class:`~autobatch.Runner`; ``_parallel`` is its
    :class:`~autobatch.training.ranks.DataParallel`, which carries the request to the ranks)."""

    _stop_reason: str | None = None  # the last request's, until a fit() ends on it (result.stop_reason)

    def request_stop(self, reason: str | None = None) -> None:
        """Ask :meth:`fit` to end after the step in progress, save its checkpoint (with
        ``checkpoint_dir``) and return with ``result.stopped`` set, and ``result.stop_reason``
        to ``reason`` (``"val_loss did not improve for 3 evaluations"``; ``None``: ``"request_stop()"``);
        under ``torch.distributed`` every rank ends after the same step (a request on any one rank
        reaches them all; the others' reason says so). Safe from a signal handler or another
        thread; a request made when no ``fit`` runs ends the next one after its first step."""
        if reason is not None and not isinstance(reason, str):
            raise TypeError(f"request_stop(reason=...) takes a string saying why the run stops, got {type(reason).__name__}")
        self._stop_reason = reason or "request_stop()"
        self._parallel.request_stop()

    def _stop_agreed(self) -> bool:
        """Whether the run ends after the step just applied (on every rank alike)."""
        return self._parallel.stop_agreed()

    def _ended_early(self, stopped: bool, epochs: int | None, steps: int | None) -> bool:
        """``result.stopped``: whether the stop ended the run before its ``epochs`` or ``steps``
        were done. One agreed in the run's last step ends nothing early: the run is complete and
        is reported so (a stopped run is one to continue; under ``torchrun`` the command line
        exited 130 without the final weights and printed a continue command that refused to
        run, the checkpoint being at ``train.steps`` already). An epoch of data without a length
        is complete only once the next draw finds nothing: a stop at its last batch is early."""
        done = (epochs is not None and self.epoch >= epochs) or (steps is not None and self.step >= steps)
        reason, self._stop_reason = self._stop_reason or "request_stop() on another rank", None
        early = stopped and not done
        self.result.stop_reason = reason if early else None
        if early:
            log.info("stopped after step %d: %s", self.step, reason)
        return early

    def _clear_stop(self) -> None:
        """Forget the request the run ended on, or one that came after its last step."""
        self._parallel.clear_stop()


def saves_on_sigterm(fit: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap :meth:`~autobatch.Runner.fit` so that a SIGTERM saves before the process ends (see
    the module): active only with a ``checkpoint_dir``, in the main thread, and where SIGTERM
    has its default action; the default is back when ``fit`` ends."""

    @functools.wraps(fit)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (getattr(self, "checkpoint_dir", None) is None or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
            return fit(self, *args, **kwargs)
        received: list[int] = []

        def handle(signum: int, frame: object) -> None:
            if received:  # a second one: the step does not end (a hung peer), or the user insists
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.raise_signal(signal.SIGTERM)
            received.append(signum)
            self.request_stop("SIGTERM")

        signal.signal(signal.SIGTERM, handle)
        result, error = None, None
        try:
            result = fit(self, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised; kept to be told before the signal ends the process
            error = exc
            raise
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if received:  # an error out of fit ends the process too: the signal was only held
                if result is not None:
                    log.warning("SIGTERM: stopped after step %d, which the checkpoint in %s holds (fit(data, "
                                "resume='latest') goes on from there); the process ends now, as the signal asked",
                                self.step, self.checkpoint_dir)
                elif error is not None:  # the signal ends the process before Python could print it (a save that failed)
                    log.error("SIGTERM: fit() raised %s after the signal, at step %d (its checkpoint may not be "
                              "written; the error says); the process ends now, as the signal asked",
                              type(error).__name__, self.step, exc_info=error)
                _flush()  # the default action ends the process at once: buffered lines (this warning) first
                signal.raise_signal(signal.SIGTERM)
        return result

    return wrapper


def _flush() -> None:
    """Write out what logging's handlers and the standard streams still buffer."""
    for handler in list(logging.getLogger().handlers) + list(log.handlers):
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a broken handler must not keep the process from ending
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
