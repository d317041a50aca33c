"""Stop ``python -m autobatch train`` on Ctrl-C or SIGTERM without losing its progress.

Before, an interrupted run (Ctrl-C, or the SIGTERM a scheduler sends before it kills a job) or
one that ran out of memory beyond recovery ended with a traceback and saved nothing: with the
default ``train.checkpoint_every=0`` every step was lost, with ``checkpoint_every=10`` the steps
since the last save. Now :class:`Interrupts` turns both signals into ``KeyboardInterrupt`` in the
main thread while the runner trains, and :func:`stopped` saves a checkpoint, prints one line
naming it and the command that continues the run, and exits 130 (SIGINT) or 143 (SIGTERM);
after the error, its one ``autobatch: error:`` line names the checkpoint too (exit status 1).
Any other error mid-run (a dataset that fails at step 900) saves the steps before it the same way.

Saving then is safe: the runner undoes a step it was stopped in (the optimizer's half-applied
update, the buffers, the random state, the micro-batch) before the exception leaves ``fit``
(:mod:`autobatch.training.runner`), so the checkpoint holds exactly the steps applied. The step
hook (its ``metrics.jsonl`` line) and every checkpoint the runner writes (:meth:`Interrupts.holding`)
run with the signals held (:meth:`Interrupts.atomic`) so neither is ever half-done; an update applied just before its
hook ran gets its line written here, so ``metrics.jsonl`` lists every step in the checkpoint.

Under ``torch.distributed`` (``torchrun``) a signal does not stop a rank where it is: saving is a
collective every rank must join, and a signal reaches the ranks at different moments (or only
some of them), so a rank that stopped alone would leave the others in a collective, and the
run used to end with nothing saved since its last ``train.checkpoint_every``. There the
signal *asks* for a stop (:meth:`autobatch.Runner.request_stop`): the request rides on the next
sync point to every rank (:mod:`autobatch.dist.stopping`), every rank finishes that step, the
runner writes the checkpoint (together), and :func:`stopped_together` prints the one line (rank
0) and exits 130 or 143 on every rank (unless that step was the run's last: the run is complete,
``result.stopped`` is False, and it ends as a finished run does). The launcher passes a Ctrl-C on to its ranks, which the
terminal already sent them: a second signal within :data:`ESCALATE_AFTER_S` of the first is that
echo; one later (the step does not end: a hung peer) stops the rank at once, saving nothing, as
before. ``torchrun`` kills its ranks 30 s after it passed a signal on (a SLURM job gets its own
grace period): a step must end within that to be saved.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..dist import agreement as dist_sync
from ..errors import StepOutOfMemoryError
from ..training.checkpoints.give_up import gave_up_together as library_gave_up_together, saved_path
from .errors import CLIError, describe, log_to_files
from .ranks import launched_rank
from .user_config import command_line

__all__ = ["Interrupts", "stopped", "stopped_together", "gave_up_together", "continue_command", "ESCALATE_AFTER_S"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: under ``defer``, a second signal this long after the first stops the rank at once (sooner: the
#: launcher's echo of the same Ctrl-C, which the terminal sent every rank already)
ESCALATE_AFTER_S = 5.0


class Interrupts:
    """While entered (in the main thread): SIGINT and SIGTERM raise ``KeyboardInterrupt``,
    except inside :meth:`atomic`, which holds one until it ends; :attr:`received` is the last
    signal. The handlers in place before are put back on exit; a signal ignored before (a
    ``nohup`` run's SIGINT) stays ignored. With ``defer`` (under ``torch.distributed``: the
    runner's ``request_stop``) a signal calls it with its name instead of raising, and only a second one at
    least :data:`ESCALATE_AFTER_S` later raises."""

    def __init__(self, enabled: bool = True, defer: Any = None) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.defer = defer
        self._first: float | None = None  # when the first deferred signal came
        self.received: signal.Signals | None = None
        self._held = 0
        self._pending = False
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> "Interrupts":
        if self.enabled:
            for sig in _SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum)
        if self.defer is not None:
            now = time.monotonic()
            if self._first is None:
                self._first = now
                self.defer(self.received.name)  # the run's result.stop_reason: "SIGINT", "SIGTERM"
                return
            if now - self._first < ESCALATE_AFTER_S:
                return  # the launcher's echo of the same Ctrl-C
        if self._held:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """Hold SIGINT and SIGTERM until the block ends, then raise ``KeyboardInterrupt``."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if self._pending and not self._held:
            self._pending = False
            raise KeyboardInterrupt

    def holding(self, save: Any) -> Any:
        """``save`` (the runner's ``save``) run inside :meth:`atomic`: a signal during a checkpoint
        write waits for it. The runner writes the ``train.checkpoint_every`` checkpoints itself,
        after the step hook (an epoch's last step as the next epoch's start, the end's not written
        again), where the hook's own ``runner.save()`` used to be held; ``fit()``'s last one, and
        one it writes as it gives up or stops on request, are held too."""

        def held(*args: Any, **kwargs: Any) -> Any:
            with self.atomic():
                return save(*args, **kwargs)

        return held

    @property
    def exit_code(self) -> int:
        """128 + the signal's number: 130 for SIGINT (also a Ctrl-C no handler saw), 143 for SIGTERM."""
        return 128 + int(self.received or signal.SIGINT)


def continue_command(out_dir: Path) -> str:
    """The command line that continues this run in its own directory (``metrics.jsonl`` then
    goes on from the checkpoint's step): its config flags and overrides, with
    ``train.resume=latest hydra.run.dir=<out_dir>``; under ``torchrun``, launched by it."""
    # a rank's own (autobatch.cli.ranks.hydra_overrides), not the user's: rank 1's line is rank 0's
    own = [] if launched_rank() == 0 else ["hydra.output_subdir"] + ["hydra/job_logging"] * ("hydra/job_logging=rank" in sys.argv)
    line = command_line("train", extra=["train.resume=latest", f"hydra.run.dir={out_dir}"], drop=["train.resume", *own])
    world = dist_sync.world_size()
    if world == 1:
        return line
    local = os.environ.get("LOCAL_WORLD_SIZE")
    launcher = f"torchrun --nproc-per-node {world}" if local == str(world) else "torchrun <this run's launcher options>"
    return line.replace("python -m autobatch", f"{launcher} -m autobatch", 1)


def gave_up_together(exc: BaseException) -> bool:
    """Under ``torch.distributed``: whether ``fit`` ended on every rank with a
    :class:`StepOutOfMemoryError` of the same step, so the steps before it may be saved as in one
    process (:func:`stopped`). The recovery's vote ends such a step on every rank alike; before,
    every rank raised it and the run was lost since its last ``train.checkpoint_every`` (the whole
    run with the default 0). The library's check
    (:func:`autobatch.training.checkpoints.give_up.gave_up_together`): the runner's give-up ran it
    already (the command line's runner has a ``checkpoint_dir``), so this reads its verdict, with
    no sync point of its own. Ranks that disagree (a rank that went on) keep their own error:
    nothing is saved, as before."""
    return library_gave_up_together(exc, dist_sync.exchange)


def stopped_together(runner: Any, interrupts: Interrupts, *, out_dir: Path) -> None:
    """After ``fit`` ended early on every rank (a signal under ``torch.distributed`` asked for it,
    on one rank or more): the runner wrote the checkpoint; print one line naming it and the
    command that continues the run (rank 0), and exit 130 or 143 on every rank (the signal the
    ranks agree on: one sync point)."""
    signum = dist_sync.agree_max(int(interrupts.received or 0), "train: the signal that stopped the run")
    name = signal.Signals(signum).name if signum else "a stop request"
    if dist_sync.is_rank_zero():
        print(f"autobatch: interrupted ({name}) at step {runner.step} on every rank; checkpoint "
              f"{runner.result.checkpoint_path}; continue with: {continue_command(out_dir)}", file=sys.stderr)
    sys.stdout.flush()
    raise SystemExit(128 + signum if signum else 130)


def _missing_line(runner: Any, logged: int | None, metrics: Any, lr: Any = None) -> None:
    """Write the ``metrics.jsonl`` line of an update that was applied but stopped before its
    hook wrote the line (a signal between the two): the checkpoint will hold that step. ``lr``:
    the rate that step was applied at (:mod:`autobatch.cli.lr_record`)."""
    if logged is not None and runner.step <= logged:
        return
    loss = getattr(runner, "_last_loss", None)
    metrics.write(json.dumps({
        "step": runner.step, "epoch": runner.epoch, "loss": None if loss is None else float(loss), "lr": lr,
        "micro_batch": runner.micro_batch, "accumulation": None, "ranks": 1, "samples": None, "seconds": None,
        "samples_per_s": None, "recoveries": len(runner.result.oom_recoveries),
    }) + "\n")  # fmt: skip
    metrics.flush()


def _saved(exc: BaseException, runner: Any) -> Any:
    """The checkpoint of the steps applied: the one the runner wrote as it gave up on ``exc`` (a step
    that fits at no micro-batch, data used up: :func:`~autobatch.training.checkpoints.give_up.saved_path`),
    else the runner's ``train.checkpoint_every`` one where it holds the state now (a signal held while it
    was written: raised once it was), else one saved now. Before, the command line saved the same state a
    second time after the runner's (twice the time and disk writes of a large model, at the moment the
    run had already failed or was asked to stop)."""
    if (path := saved_path(exc)) is not None:
        return path
    return runner.result.checkpoint_path if runner._holds_step_save() else runner.save()


def stopped(exc: BaseException, runner: Any, interrupts: Interrupts, *, out_dir: Path, logged: int | None,
            metrics: Any, resume: Path | None, lr: Any = None) -> None:
    """After ``fit`` stopped on an interrupt or an error: save what the run applied (``logged``:
    the last step whose line this run wrote; None: no step of this run finished, nothing new to
    keep) and say how to continue. An interrupt then exits 130 or 143 with one line; an error
    becomes one :class:`CLIError` line: its own message and exit status, then the checkpoint.
    A :class:`StepOutOfMemoryError` whose save fails raises the save's error, never hidden; any
    other error is raised as it is when no step finished, else its line says the save failed."""
    if not isinstance(exc, (KeyboardInterrupt, StepOutOfMemoryError)):
        _error_saved(exc, runner, out_dir=out_dir, logged=logged, metrics=metrics, lr=lr)
        return
    if logged is None:
        again = f"; continue with: {continue_command(out_dir)}" if resume is not None else ""
        line = f"no step of this run finished, nothing saved{again}"
    else:
        _missing_line(runner, logged, metrics, lr)
        line = f"checkpoint {_saved(exc, runner)}; continue with: {continue_command(out_dir)}"
    if isinstance(exc, StepOutOfMemoryError):
        message, code = describe(exc)
        saved = "" if logged is None else f"the steps before it are saved, step {runner.step}: "  # (none: said in `line`)
        raise CLIError(f"{message.rstrip('.')}; {saved}{line}", code) from exc
    name = (interrupts.received or signal.SIGINT).name
    from .sweep import record_interrupted

    record_interrupted(f"interrupted ({name}) at step {runner.step}; {line}")  # a sweep's job: its row says so
    log_to_files(f"autobatch: interrupted ({name}) at step {runner.step}; {line}", logging.WARNING)
    print(f"autobatch: interrupted ({name}) at step {runner.step}; {line}", file=sys.stderr)
    sys.stdout.flush()
    raise SystemExit(interrupts.exit_code)


def _error_saved(exc: BaseException, runner: Any, *, out_dir: Path, logged: int | None, metrics: Any,
                 lr: Any = None) -> None:
    """Any other error mid-run (a sample the dataset cannot read, a bug in the model at step
    900): before, every step since the last ``train.checkpoint_every`` save was lost (the whole
    run with the default 0), and the run directory was left holding a run nothing could
    continue. The runner undid the step the error stopped, so the steps applied are saved as an
    interrupt's are, and the error's one line says so; with no step finished it is left as it is."""
    if logged is None:
        return
    message, code = describe(exc)
    try:
        _missing_line(runner, logged, metrics, lr)
        line = f"checkpoint {_saved(exc, runner)}; continue with: {continue_command(out_dir)}"
    except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
        raise CLIError(f"{message.rstrip('.')}; the checkpoint of step {runner.step} could not be written "
                       f"({describe(error)[0]})", code) from exc
    raise CLIError(f"{message.rstrip('.')}; the steps before it are saved, step {runner.step}: {line}", code) from exc
