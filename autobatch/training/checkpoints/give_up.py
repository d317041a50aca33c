"""What a run saves when it gives up: the steps trained before a step that fits at no micro-batch.

Where ``fit`` gives up (a step that fits at no micro-batch, data used up, the data raising while
a batch is drawn) the step given up was undone, so the runner's state is that of the last step
trained: with a ``checkpoint_dir`` it is written there before the error is raised, and a note on
the error names the file. Before, up to ``checkpoint_every`` steps were lost, a whole run without it.

Under ``torch.distributed`` ``save()`` is a collective every rank must join, so a rank may save
only where every rank saves. A :class:`~autobatch.errors.StepOutOfMemoryError` is the one give-up
the ranks reach alike: the recovery's vote (:mod:`autobatch.training.oom.recovery_vote`) ends that
step on every rank. :func:`gave_up_together` checks it (one sync point, entered by every rank that
raised one): every rank at the same step, and none holding weights it may not save
(``step_guard="off"`` stopped inside ``optimizer.step()``); then every rank saves together. Ranks
that disagree (a rank that went on) keep their own error and save nothing, with a note saying so.
Before, a distributed ``Runner`` saved nothing on give-up; the command line had its own copy of
the check (``autobatch.cli.interrupt``), which now calls this one and reads the verdict the runner
reached, so the ranks meet at that sync point once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ...errors import RankDisagreementError, StepOutOfMemoryError, add_note

__all__ = ["gave_up_together", "saved_on_give_up", "saved_path", "GAVE_UP"]

#: the label of the give-up's sync point (every rank's row: ``[step given up, may save]``)
GAVE_UP = "every rank gave up on the same step"


def gave_up_together(exc: BaseException, exchange: Callable[[list[int], str], list[list[int]]], *,
                     savable: bool = True) -> bool:
    """Under ``torch.distributed``: whether ``fit`` ended on every rank with a
    :class:`StepOutOfMemoryError` of the same step, and every rank may save (``savable``: this
    rank's weights hold no half-applied update), so the steps before it may be saved as in one
    process. One sync point (``exchange``) for a ``StepOutOfMemoryError``, none for any other
    error (False); the verdict is kept on ``exc``, so a second call (the command line's, after
    the runner's) reads it without another sync point. Where it is False a note says why."""
    if not isinstance(exc, StepOutOfMemoryError):
        return False
    known = getattr(exc, "_autobatch_every_rank", None)
    if known is not None:
        return known
    try:
        rows = exchange([exc.step, int(savable)], GAVE_UP)
    except RankDisagreementError as error:
        add_note(exc, f"autobatch: not saved, the ranks did not all stop at step {exc.step} ({error})")
        verdict = False
    else:
        elsewhere = {rank: row[0] for rank, row in enumerate(rows) if row[0] != exc.step}
        torn = [str(rank) for rank, row in enumerate(rows) if not row[1]]
        if elsewhere:
            add_note(exc, f"autobatch: not saved, the ranks gave up at different steps (step {exc.step} here; "
                          + ", ".join(f"rank {rank} step {step}" for rank, step in elsewhere.items()) + ")")
        elif torn:
            add_note(exc, f"autobatch: not saved, rank {', '.join(torn)} stopped inside optimizer.step() with "
                          "step_guard='off', so its weights may hold part of the step given up")
        verdict = not elsewhere and not torn
    exc._autobatch_every_rank = verdict  # type: ignore[attr-defined]
    return verdict


def saved_on_give_up(runner: Any, exc: BaseException) -> BaseException:
    """``exc``, after the steps ``runner`` trained since its last checkpoint are written to its
    ``checkpoint_dir`` (a note on ``exc`` names the file, or says why the write failed). Not
    without a ``checkpoint_dir``, nor where the weights may hold an update the step count does
    not (``step_guard="off"``), nor before this ``fit()`` trained a step (an earlier run's
    checkpoint there is kept); under ``torch.distributed`` only where :func:`gave_up_together`
    (every rank saves together)."""
    if runner.checkpoint_dir is None:
        return exc
    if runner.distributed:  # every rank is here alike (same checkpoint_dir, agreed before the run)
        if not gave_up_together(exc, runner._parallel.exchange, savable=runner._torn is None):
            return exc
    elif runner._torn is not None:
        return exc
    if not runner.result.steps_this_run:  # the same on every rank: they train in lockstep
        return exc  # nothing trained in this fit(): an earlier run's checkpoint there is kept
    try:
        path: Path = runner.save()
    except Exception as error:  # noqa: BLE001 - the give-up's own error is the one to raise
        add_note(exc, f"autobatch: the checkpoint of step {runner.step} could not be written ({error})")
    else:
        exc._autobatch_saved = path  # type: ignore[attr-defined]  # read by saved_path(): a caller saves it once
        trained = f"the {runner.step} steps trained are" if runner.step != 1 else "the 1 step trained is"
        add_note(exc, f"autobatch: {trained} saved in {path} (the step given up is not "
                      "counted); go on from there with fit(data, resume=...)")
    return exc


def saved_path(exc: BaseException) -> Path | None:
    """The checkpoint :func:`saved_on_give_up` wrote before ``exc`` was raised (the steps trained,
    the step given up not counted), or None where it wrote none. A caller that saves what a run
    trained when it fails (the command line: :mod:`autobatch.cli.interrupt`) names this file
    instead of writing the same state a second time."""
    return getattr(exc, "_autobatch_saved", None)
