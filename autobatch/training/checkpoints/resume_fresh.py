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
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from .checkpoint_io import CHECKPOINT_NAME
from .sharded_files import base_path, sharded_path, sharded_sets

__all__ = ["earlier_path", "next_earlier_number", "keep_earlier_run"]

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


def keep_earlier_run(checkpoint_dir: Path, parallel: Any, *, sharded: bool) -> None:
    """Called before a fresh run's first save into ``checkpoint_dir`` (not at its ``fit()``'s
    start: a run that fails before it saves leaves the earlier run's ``last.pt`` in place). Move
    the checkpoint file this rank's saves would replace (``last.pt``, written by rank 0;
    under FSDP2 (``sharded``) each rank's own ``last.rank<r>-of-<w>.pt``) aside to
    :func:`earlier_path`, and warn where it now is and how to resume from it; warn of another
    checkpoint held there that this run's saves leave as it is. A sharded run's ranks agree on
    the number first (the largest each read: a sync point, so no rank moves its file before every
    rank has read the folder); ``parallel`` is the runner's
    (:class:`~autobatch.training.ranks.DataParallel`)."""
    if not (sharded or parallel.is_rank_zero()):
        return  # rank 0 writes last.pt
    own = sharded_path(checkpoint_dir / CHECKPOINT_NAME) if sharded else checkpoint_dir / CHECKPOINT_NAME
    number = next_earlier_number(checkpoint_dir) if checkpoint_dir.is_dir() else 1
    if sharded:
        number = max(row[0] for row in parallel.exchange([number], "checkpoint_dir: an earlier run's number"))
    if own.is_file():
        kept = earlier_path(own, number)
        os.replace(own, kept)  # kept names no file: its number is above every kept one's
        log.warning(
            "checkpoint_dir=%r already holds a checkpoint (%s) of another run, which this run, started afresh (fit() "
            "without resume=), would have overwritten: it is kept as %s%s; to continue that run, pass fit(..., "
            "resume=%r)", str(checkpoint_dir), own.name, kept,
            " (this rank's file; every rank's has the same number)" if sharded else "", str(base_path(kept)))
        return
    held = checkpoint_dir / CHECKPOINT_NAME
    others = ([held.name] if held.is_file() else []) + [
        f"{_STEM}.rank<r>-of-{world}{_SUFFIX}" for world in sharded_sets(held)]
    if others:
        log.warning("checkpoint_dir=%r already holds another run's checkpoint (%s), which this run, started afresh "
                    "(fit() without resume=), leaves as it is and writes its own beside; to continue that run "
                    "instead, pass fit(..., resume=%r)", str(checkpoint_dir), ", ".join(others), str(checkpoint_dir))
