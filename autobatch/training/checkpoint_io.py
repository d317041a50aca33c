"""Atomic training checkpoints: a crash mid-write never leaves a torn or missing checkpoint.

``save_checkpoint`` writes to a temporary file in the checkpoint's own directory, flushes and
``fsync``s it, then ``os.replace``s it over the old checkpoint (atomic on POSIX and Windows
when both are on one file system) and ``fsync``s the directory so the rename itself survives
a power cut. A process killed at any instant leaves either the old checkpoint or the new one,
never half of one; a stale temporary file from a killed writer is harmless and is replaced
by the next save.

Also here: the random number generator states a checkpoint must carry for a resumed run to
draw the same numbers (dropout masks, a shuffled DataLoader's order) as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint", "rng_state", "set_rng_state", "CHECKPOINT_NAME"]

log = logging.getLogger("autobatch")

#: File name of the runner's checkpoint inside ``checkpoint_dir``.
CHECKPOINT_NAME = "last.pt"


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` (anything ``torch.save`` takes) to ``path`` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it is a file, else ``path / CHECKPOINT_NAME``."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (a file, or the directory holding it)."""
    path = resolve_checkpoint(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    # weights_only=False: the checkpoint holds RNG states and plain Python values we wrote.
    return torch.load(path, map_location="cpu", weights_only=False)


def rng_state() -> dict[str, Any]:
    """The CPU, CUDA (every device, when initialised), Python and NumPy generator states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:  # numpy is optional
        pass
    else:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
