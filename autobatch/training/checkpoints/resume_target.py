"""What ``resume=`` names: a checkpoint file, its directory, or ``"latest"``.

``"latest"`` is the command line's word (``train.resume=latest``) for "continue from the newest
checkpoint there is": the runner takes it too, as the checkpoint in its own ``checkpoint_dir``
(it writes one there, ``last.pt``, or a sharded set of ``last.rank<r>-of-<world>.pt`` under
FSDP2). Both read a checkpoint directory with :func:`latest_checkpoint`; the command line also
searches its run directories (:func:`~autobatch.cli.training.find_resume`) and compares them
with :func:`written_at`. With none written, ``"latest"`` is one error, as on the command line:
a typo'd or empty ``checkpoint_dir`` would otherwise quietly train from scratch.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint_io import CHECKPOINT_NAME, kept_earlier
from .sharded_files import sharded_sets

__all__ = ["LATEST", "checkpoint_written", "latest_checkpoint", "written_at", "resume_target"]

#: The ``resume=`` value meaning the newest checkpoint (the command line's ``train.resume=latest``).
LATEST = "latest"


def checkpoint_written(path: Path) -> bool:
    """Whether the checkpoint ``path`` names (a ``last.pt``) was written (a sharded one: any of its files)."""
    return path.is_file() or bool(sharded_sets(path))


def written_at(path: Path) -> float:
    """When the checkpoint ``path`` names was written (a sharded one: its rank 0 file)."""
    return (path if path.is_file() else next(path.parent.glob(f"{path.stem}.rank0-of-*{path.suffix}"))).stat().st_mtime


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The checkpoint the runner wrote in ``checkpoint_dir`` (``checkpoint_dir/last.pt``, the name
    a sharded set is read by too), or None where it wrote none there."""
    path = Path(checkpoint_dir).expanduser() / CHECKPOINT_NAME
    return path if checkpoint_written(path) else None


def resume_target(resume: object, checkpoint_dir: Path | None) -> str | os.PathLike:
    """The checkpoint a runner's ``resume=`` names: ``resume`` itself (a file or a directory), or
    for ``"latest"`` the one in ``checkpoint_dir``. Anything else is one error saying what to give:
    ``resume=True`` failed in ``Path()`` with "expected str, bytes or os.PathLike"."""
    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume={resume!r} is no checkpoint: give the last.pt a runner wrote, its checkpoint_dir "
                        f"(resume={str(checkpoint_dir or 'ckpt')!r}) or 'latest'; resume=None starts afresh")
    if resume != LATEST:
        return resume
    if checkpoint_dir is None:
        raise ValueError("resume='latest' resumes from the runner's checkpoint_dir, and it has none: pass "
                         "Runner(..., checkpoint_dir=...) (where the run to continue wrote last.pt), or give "
                         "resume= the checkpoint's path")
    found = latest_checkpoint(checkpoint_dir)
    if found is None:
        raise ValueError(f"resume='latest': no checkpoint in {checkpoint_dir} (no {CHECKPOINT_NAME} written there"
                         f"{kept_earlier(Path(checkpoint_dir).expanduser())}); give the path of a last.pt, or resume=None "
                         "to start afresh")
    return found
