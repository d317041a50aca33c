"""A run started afresh keeps the checkpoint another run left in its ``checkpoint_dir``.

A runner's first ``fit()`` without ``resume=`` into a ``checkpoint_dir`` that holds another
run's ``last.pt`` (or, under FSDP2, its ``last.rank<r>-of-<world>.pt`` files) replaced it at its
first save: a script run again without ``resume=`` lost the progress of the run it had written
(before, only a warning said so). That checkpoint is now moved aside right before that save, to
``last.earlier-<n>.pt`` (a sharded set's files to ``last.earlier-<n>.rank<r>-of-<world>.pt``,
each rank moving its own, all under one ``n``), ``n`` one more than any earlier run's kept
there, so nothing kept is ever replaced; the warning names the file and the ``fit(...,
resume=...)`` that continues it (a path ``resume=`` reads as any checkpoint's: a sharded set by
the ``last.earlier-<n>.pt`` its files are named after). The command line's ``train`` refuses
such a start instead (:func:`~autobatch.cli.training.check_fresh_target`).

Every save goes through ``Runner.save()``, which moves it aside before the run's first save
into ``checkpoint_dir`` whatever made it: a ``fit()``'s, or one called by hand before any
``fit()`` (that one overwrote it silently), or that of a run resumed from another file (such
as a ``last.earlier-<n>.pt`` there: it replaced the later run's ``last.pt``). A run's later
saves, and a run resumed from that folder's own ``last.pt``, move nothing. A move that fails on
one rank (a ``PermissionError``) is agreed on by every rank, which all raise, instead of that
rank raising alone and its peers waiting at the save's next sync point (:func:`_agree_kept`).

Two runs writing into one ``checkpoint_dir`` at once: the second's first save keeps the first's
``last.pt`` aside, and the first's next save then replaced the second's ``last.pt``, silently
(that run's progress lost). A run now remembers the file it wrote (:func:`file_mark`); where a
later save finds another in its place (:func:`replaced_since`), it leaves that file alone, writes
its own checkpoint to the next ``last.earlier-<n>.pt`` and stops with one ``ValueError`` naming it
(:func:`shared_dir_error`): the other run goes on, and no save of either replaces the other's.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from ...errors import PeerFailedError, add_note
from ..pacing import told_every_rank
from .checkpoint_io import CHECKPOINT_NAME
from .sharded_files import base_path, sharded_path, sharded_sets

__all__ = ["earlier_path", "next_earlier_number", "keep_earlier_run", "put_back", "continues_in", "file_mark",
           "replaced_since", "shared_dir_error"]

log = logging.getLogger("autobatch")

_STEM, _SUFFIX = os.path.splitext(CHECKPOINT_NAME)
_EARLIER = re.compile(rf"^{re.escape(_STEM)}\.earlier-(?P<n>\d+)(\.rank\d+-of-\d+)?{re.escape(_SUFFIX)}$")


def earlier_path(path: Path, number: int) -> Path:
    """Where the checkpoint file ``path`` (``last.pt``, or a sharded set's ``last.rank<r>-of-<w>.pt``)
    is kept as earlier run ``number``: ``last.earlier-<n>.pt``, ``last.earlier-<n>.rank<r>-of-<w>.pt``."""
    return path.with_name(path.name.replace(_STEM, f"{_STEM}.earlier-{number}", 1))


def next_earlier_number(checkpoint_dir: Path) -> int:
    """One more than the number of any earlier run's checkpoint kept in ``checkpoint_dir`` (1: none)."""
    numbers = [int(match["n"]) for name in os.listdir(checkpoint_dir) if (match := _EARLIER.match(name))]
    return max(numbers, default=0) + 1


def continues_in(checkpoint_dir: Path | None, resumed: Path) -> bool:
    """Whether a run resumed from ``resumed`` (this rank's file) continues the checkpoint its
    ``checkpoint_dir`` holds (``last.pt``, or a sharded set's file): its saves replace that file,
    which is its own. Resumed from elsewhere (another folder, a ``last.earlier-<n>.pt`` kept
    there), the ``last.pt`` there is another run's, kept at this run's first save."""
    if checkpoint_dir is None:
        return False
    return base_path(resumed).resolve() == (checkpoint_dir / CHECKPOINT_NAME).resolve()


def file_mark(path: Path) -> tuple[int, int, int] | None:
    """What tells the checkpoint file a run wrote from one another run put in its place (every
    save renames a new file there): its inode, size and modification time; None: no file."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def replaced_since(checkpoint_dir: Path, mark: tuple[int, int, int] | None, parallel: Any, *, sharded: bool) -> int | None:
    """None where the file this rank's saves replace (``last.pt``, rank 0's; a sharded run's own
    file) is still the one this run last wrote or resumed from (``mark``; None: not known, so not
    checked) or is gone; else the number of the ``last.earlier-<n>.pt`` this run's checkpoint is
    written to instead: another run writes into ``checkpoint_dir`` too. Agreed by every rank
    under ``torch.distributed`` (one sync point), as the path every rank writes is."""
    own = sharded_path(checkpoint_dir / CHECKPOINT_NAME) if sharded else checkpoint_dir / CHECKPOINT_NAME
    now = file_mark(own) if mark is not None else None
    replaced = now is not None and now != mark
    number = next_earlier_number(checkpoint_dir) if replaced else 0
    if parallel.world_size() > 1:
        rows = parallel.exchange([int(replaced), number], "checkpoint_dir: another run's file in this run's place")
        replaced, number = any(row[0] for row in rows), max(row[1] for row in rows)
    return number if replaced else None


def shared_dir_error(checkpoint_dir: Path, written: Path, step: int) -> ValueError:
    """The error a run stops with once its checkpoint is written beside another run's (:func:`replaced_since`)."""
    return ValueError(
        f"checkpoint_dir={str(checkpoint_dir)!r} is written by another run too: its {CHECKPOINT_NAME} replaced the one "
        f"this run wrote there, and this save would have replaced it in turn, losing that run's progress. This "
        f"run's checkpoint of step {step} is written to {written} instead, and the run stops: give each run its own "
        f"checkpoint_dir, and continue this one in its own with fit(..., resume={str(base_path(written))!r})")


def keep_earlier_run(checkpoint_dir: Path, parallel: Any, *, sharded: bool) -> Path | None:
    """Called right before a run's first save into ``checkpoint_dir`` (its first ``fit()``'s,
    without ``resume=`` or resumed from elsewhere, or a ``runner.save()`` before any; not at a
    ``fit()``'s start: a run that fails before it saves leaves the earlier run's ``last.pt`` in
    place), on every rank. Move the checkpoint file this rank's saves would replace (``last.pt``,
    written by rank 0; under FSDP2 (``sharded``) each rank's own ``last.rank<r>-of-<w>.pt``)
    aside to :func:`earlier_path`, and warn where it now is and how to resume from it; warn of
    another checkpoint held there that this run's saves leave as it is. A sharded run's ranks
    agree on the number first (the largest each read: a sync point, so no rank moves its file
    before every rank has read the folder), then, under ``torch.distributed``, that every rank
    moved its file (:func:`_agree_kept`); ``parallel`` is the runner's
    (:class:`~autobatch.training.ranks.DataParallel`). Returns where this rank's file is kept
    (None: nothing moved), for :func:`put_back` where the save then writes nothing."""
    moves = sharded or parallel.is_rank_zero()  # rank 0 writes last.pt
    own = sharded_path(checkpoint_dir / CHECKPOINT_NAME) if sharded else checkpoint_dir / CHECKPOINT_NAME
    number, failure, kept = 1, None, None
    try:
        if moves and checkpoint_dir.is_dir():
            number = next_earlier_number(checkpoint_dir)
    except OSError as exc:  # a folder this rank cannot list: told to every rank below, not raised before the sync points
        failure = exc
    if sharded:
        number = max(row[0] for row in parallel.exchange([number], "checkpoint_dir: an earlier run's number"))
    if failure is None and moves and own.is_file():
        try:
            os.replace(own, target := earlier_path(own, number))  # it names no file: its number is above every kept one's
            kept = target
        except OSError as exc:  # a PermissionError: on this rank only, its peers would wait at the save's sync point
            failure = exc
    _agree_kept(parallel, checkpoint_dir, own, kept, failure, sharded=sharded)
    if kept is not None:
        log.warning(
            "checkpoint_dir=%r already holds a checkpoint (%s) of another run, which this run's first save there "
            "would have overwritten: it is kept as %s%s; to continue that run, pass fit(..., resume=%r)",
            str(checkpoint_dir), own.name, kept,
            " (this rank's file; every rank's has the same number)" if sharded else "", str(base_path(kept)))
        return kept
    held = checkpoint_dir / CHECKPOINT_NAME
    others = ([held.name] if held.is_file() else []) + [
        f"{_STEM}.rank<r>-of-{world}{_SUFFIX}" for world in sharded_sets(held)]
    if moves and others:
        log.warning("checkpoint_dir=%r already holds another run's checkpoint (%s), which this run leaves as it is "
                    "and writes its own beside; to continue that run instead, pass fit(..., resume=%r)",
                    str(checkpoint_dir), ", ".join(others), str(checkpoint_dir))
    return None


def put_back(kept: Path | None, own: Path) -> bool:
    """Move the earlier run's checkpoint that this run's first save moved aside (``kept``, by
    :func:`keep_earlier_run`) back to ``own`` where that save wrote nothing there (a full disk, a
    permission, an interrupt before its rename); True where it did. Before, the folder was left
    with no ``last.pt``: ``resume="latest"`` said none was written, and the save's error said
    ``last.pt`` "holds the previous checkpoint". The runner's next save moves it aside again. Not
    for FSDP2's shards, whose ranks moved theirs together, nor under DDP, where only rank 0 would know (the
    ranks' next save must take the same path; the warning names where the file is)."""
    if kept is None or os.path.lexists(own):  # the new file is in place (an interrupt after its rename): kept stays
        return False
    try:
        os.replace(kept, own)
    except OSError:  # it stays where the warning said it is
        return False
    log.warning("the checkpoint was not written, so the earlier run's checkpoint kept as %s is moved back to %s",
                kept, own)
    return True


def _agree_kept(parallel: Any, checkpoint_dir: Path, own: Path, kept: Path | None, failure: OSError | None, *,
                sharded: bool) -> None:
    """Every rank raises where one could not move its earlier run's file aside (``failure``:
    this rank's error), after one sync point under ``torch.distributed``: that rank its own
    ``OSError`` with a note, the others a :class:`~autobatch.errors.PeerFailedError`, each naming
    the file and what to do. Before, the failing rank raised alone and its peers waited at the
    save's next sync point for it. Nothing is written, a rank that moved its file (``kept``) moves
    it back (a sharded set is never split over two numbers), and the runner's next ``save()``
    tries again (the run, held by the runner, is not lost). The same where that sync point itself
    raises (a ``runner.save()`` called on rank 0 only, a peer gone: a ``RankDisagreementError``):
    rank 0 had renamed the earlier run's ``last.pt`` to ``last.earlier-<n>.pt`` without its
    warning, and left it there; it moves it back before the error propagates."""
    failed = []
    if parallel.world_size() > 1:
        try:
            rows = parallel.exchange([int(failure is not None)], "checkpoint_dir: every rank kept the earlier run's file")
        except BaseException:  # the ranks met elsewhere (a save() on rank 0 only): nothing is written, the file stays
            if kept is not None:
                os.replace(kept, own)
            raise
        failed = [rank for rank, row in enumerate(rows) if row[0]]
    if failure is None and not failed:
        return
    if kept is not None:
        os.replace(kept, own)  # back where it was: renamed by this process a moment ago, in the same folder
    files = [own] if failure is not None else [
        sharded_path(own, rank, parallel.world_size()) if sharded else own for rank in failed]
    todo = (f"{' and '.join(str(file) for file in files)}, another run's checkpoint, which this run would overwrite, "
            "could not be moved aside (to last.earlier-<n>.pt); nothing was written. Move it out of checkpoint_dir="
            f"{str(checkpoint_dir)!r} yourself (or make it writable), then runner.save() or fit(data, ...) goes on "
            "from this runner's state (the move is tried again first); or give the Runner another checkpoint_dir; "
            f"to continue that run instead, pass fit(..., resume={str(checkpoint_dir)!r})")
    if failure is not None:
        raise told_every_rank(add_note(failure, f"autobatch: {todo}"))  # every rank raises with it (a hook's save too)
    raise PeerFailedError(f"rank {', '.join(map(str, failed))}: {todo}; rank {parallel.rank()} stops too instead of "
                          "waiting for it", failed)
