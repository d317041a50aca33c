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
"""

from __future__ import annotations

__all__ = ["Stoppable"]


class Stoppable:
    """The runner's stop request (a mixin of :class:`~autobatch.Runner`; ``_parallel`` is its
    :class:`~autobatch.training.ranks.DataParallel`, which carries the request to the ranks)."""

    def request_stop(self) -> None:
        """Ask :meth:`fit` to end after the step in progress, save its checkpoint (with
        ``checkpoint_dir``) and return with ``result.stopped`` set; under ``torch.distributed``
        every rank ends after the same step (a request on any one rank reaches them all).
        Safe from a signal handler or another thread; a request made when no ``fit`` runs ends
        the next one after its first step."""
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
        return stopped and not done

    def _clear_stop(self) -> None:
        """Forget the request the run ended on, or one that came after its last step."""
        self._parallel.clear_stop()
