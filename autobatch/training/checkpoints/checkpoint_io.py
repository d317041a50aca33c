"""Atomic training checkpoints: a crash mid-write never leaves a torn or missing checkpoint.

``save_checkpoint`` writes to a temporary file in the checkpoint's own directory, flushes and
``fsync``s it, then ``os.replace``s it over the old checkpoint (atomic on POSIX and Windows
when both are on one file system) and ``fsync``s the directory so the rename itself survives
a power cut. A process killed at any instant leaves either the old checkpoint or the new one,
never half of one; a stale temporary file from a killed writer (its process gone) is removed
by the next save that completes, and a resume from a folder holding only such a file says so.

Loading never runs code: checkpoints are read with ``torch.load(weights_only=True)``, which
refuses any pickled object that is not a tensor or a plain value (a file carrying a
``__reduce__`` payload is refused before anything in it runs). Everything the runner saves is
such a value: the random generator states are stored as tensors and lists. A file that is not
an autobatch checkpoint, a truncated one, one whose bytes were changed after it was written
(every entry's CRC32 is checked first: :mod:`~autobatch.training.checkpoints.integrity`), or one
that holds code, raises one :class:`~autobatch.errors.CheckpointError` naming the file and what to do.

Also here: the random number generator states a checkpoint must carry for a resumed run to
draw the same numbers (dropout masks, a shuffled DataLoader's order) as an uninterrupted one
(read and put back by :mod:`autobatch.probe.snapshot.rng`, which the probe's restore shares).
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, add_note
from ...memory.units import format_bytes
from ...probe.snapshot.rng import rng_state, set_rng_state  # the checkpoint carries them; re-exported here
from .loader_rng import data_generators  # re-exported here
from .integrity import check_intact, earlier_kept

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint", "kept_earlier", "write_cleared", "rng_state", "set_rng_state", "data_generators", "CHECKPOINT_NAME", "RUNNER_FORMAT"]


#: File name of the runner's checkpoint inside ``checkpoint_dir``.
CHECKPOINT_NAME = "last.pt"
#: The ``format`` key of the runner's checkpoints.
RUNNER_FORMAT = "autobatch.runner/1"


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` (anything ``torch.save`` takes) to ``path`` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    sink = None
    try:
        with open(tmp, "wb") as handle:
            sink = _KeepsWriteError(handle)
            try:
                torch.save(state, sink)
            except Exception as exc:
                if sink.error is None:
                    raise
                raise sink.error from exc  # the disk's error, which torch reported as "unexpected pos 171456 vs 171348"
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            _name_the_checkpoint(exc, path, sink.written if sink is not None else 0)
        raise
    _fsync_dir(path.parent)
    _remove_stale_temporaries(path)
    return path


def _temporaries(path: Path) -> list[Path]:
    """The temporary files writers of ``path`` left beside it (``.last.pt.tmp-<pid>``)."""
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of writers of ``path`` that were killed mid-write (their
    process is gone), once a newer checkpoint is whole in place: each was as large as a
    checkpoint, and one was left for every run killed while it saved (a new process's pid
    never matched it, so no later save replaced it). A live writer's file is left alone."""
    for stale in _temporaries(path):
        pid = stale.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            stale.unlink()
        except OSError:  # removed by another process, or not ours to remove: harmless either way
            pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (where it cannot be told: True, kept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError, ValueError):
        return True
    return True


class _KeepsWriteError:
    """A file handle for ``torch.save`` that keeps the first ``OSError`` its writes raised.
    ``torch.save`` swallows it: a full disk, a quota or a file-size limit surfaced as
    ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 171456 vs 171348``,
    which names neither the cause nor the file."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.error: OSError | None = None
        self.written = 0  # bytes the file took before a write was refused: what the checkpoint needs at least

    def write(self, data: Any) -> int:
        try:
            count = self._handle.write(data)
            self.written += count or 0
            return count
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._handle.flush()


def _name_the_checkpoint(exc: OSError, path: Path, written: int) -> None:
    """Name ``path`` in ``exc`` (``[Errno 28] No space left on device: '.../last.pt'``), and say
    that the file there was not replaced: it still holds the previous checkpoint, whole. A full
    disk or quota also says how much room the checkpoint needs, against what its folder has
    free (:func:`_room_needed`)."""
    if exc.errno is not None and exc.filename is None:
        exc.filename = str(path)
    add_note(exc, f"autobatch: the checkpoint was not written, and {path} was not replaced: it holds the previous "
                  "checkpoint, if one was written, whole")
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        add_note(exc, _room_needed(path, written))


def _room_needed(path: Path, written: int) -> str:
    """How much room a checkpoint refused for space needs: more than the ``written`` bytes its
    partial file (removed) took, about the size of the previous one there, against what
    ``path``'s folder has free now. Before, the error named neither, so what to free was a guess."""
    previous = _size(path)
    try:
        free = format_bytes(shutil.disk_usage(path.parent).free)
    except OSError:
        free = "an unknown amount"
    refused = f", more than the {format_bytes(written)} written before the disk refused" if written else ""
    need = f"about {format_bytes(previous)} (the previous checkpoint's size){refused}" if previous else f"more room{refused}"
    return f"autobatch: {path.parent} has {free} free (the partial file removed); a checkpoint there needs {need}"


def write_cleared(exc: OSError) -> str:
    """What must change before a checkpoint write that raised ``exc`` can succeed, for a note that
    says so (it said "once there is room" for a permission denied too)."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "checkpoint_dir is writable again (its permissions, or a read-only file system)"
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG):  # no EDQUOT on Windows
        return "there is room"
    return "the cause above is fixed"


def kept_earlier(directory: Path) -> str:
    """Where ``directory`` holds no ``last.pt``: a note naming the newest whole earlier run's
    checkpoint kept there (``last.earlier-<n>.pt``, moved aside by a later run's first save:
    :mod:`~autobatch.training.checkpoints.resume_fresh`; :func:`earlier_kept`), and the ``resume=``
    that continues it; "" where none is. A run killed in that first save left only that file, and
    the resume's error named only the ``last.pt`` it lacked, as if no checkpoint were there."""
    newest = earlier_kept(directory / CHECKPOINT_NAME)
    if newest is None:
        return ""
    return (f"; the folder holds {newest.name}, an earlier run's checkpoint a later run moved aside at its first save "
            f"(a run stopped in that save writes no {CHECKPOINT_NAME}): resume={str(newest)!r} continues it")


def resolve_checkpoint(path: str | os.PathLike, folder: Path | None = None) -> Path:
    """``path`` itself when it is a file, else ``path / CHECKPOINT_NAME``; ``~`` is the home folder
    (not a folder named ``~`` in the working directory, as ``Path`` alone reads it). A folder not
    made yet is one still: ``path`` written with a trailing separator (``"best/"``), or ``folder``
    (the runner's ``checkpoint_dir``, made at its first save); read as a file's name, a
    ``runner.save(checkpoint_dir)`` before that save wrote a file there, and every save after it
    failed (``FileExistsError``)."""
    named = os.fspath(path)
    path = Path(path).expanduser()
    folder_named = named.endswith(("/", os.sep)) or (folder is not None and path.resolve() == folder.expanduser().resolve())
    return path / CHECKPOINT_NAME if path.is_dir() or (folder_named and not path.exists()) else path


def load_checkpoint(path: str | os.PathLike, *, expect_format: str | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (a file, or the directory holding it),
    never running code; with ``expect_format``, also check its ``format`` key (the runner's
    checkpoints carry :data:`RUNNER_FORMAT`)."""
    path = resolve_checkpoint(path)
    if not path.is_file():
        partial = _temporaries(path) if path.parent.is_dir() else []
        interrupted = (f"; {partial[0].name} there is a write that was interrupted (incomplete, not a checkpoint)"
                       if partial else "")
        kept = kept_earlier(path.parent) if path.name == CHECKPOINT_NAME else ""
        raise FileNotFoundError(f"no checkpoint at {path}{interrupted}{kept}: give the last.pt a runner wrote, or its "
                                "checkpoint_dir (fit(resume=None) starts afresh)")
    if _size(path) == 0:  # before, "not an autobatch checkpoint ... resume from the last.pt the runner wrote": it was
        raise CheckpointError(path, "it is empty (0 bytes): the checkpoint in it was lost (a copy cut short, a crash on a "
                                    "file system that had not written it yet); resume from an earlier checkpoint or start afresh")
    if not written_by_torch_save(path):  # torch would read it as a legacy pickle and blame its objects
        raise CheckpointError(path, "it is not an autobatch checkpoint (not a file torch.save writes); resume from the "
                                    "last.pt autobatch's runner wrote")
    try:
        check_intact(path)  # every entry's CRC32: torch.load checks none, and loaded damaged weights silently
    except OSError as exc:
        raise _unreadable(path, exc) from None
    try:
        # weights_only=True: tensors and plain values only; a pickled object is refused unrun
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only load failed" not in str(exc).lower():
            raise _unreadable(path, exc) from None
        lines = [line.strip() for line in str(exc).splitlines() if "unsupported" in line.lower() or "error:" in line.lower()]
        reason = (lines[-1] if lines else "a pickled object")[:200]
        raise CheckpointError(
            path, "it holds objects that are not tensors or plain values, and loading it could run code "
            f"({reason}); autobatch never loads such a file. Use a checkpoint written by autobatch's runner",
        ) from None
    except (RuntimeError, EOFError, KeyError, ValueError, zipfile.BadZipFile, OSError) as exc:
        raise _unreadable(path, exc) from None
    if expect_format is not None and (not isinstance(state, dict) or state.get("format") != expect_format):
        raise CheckpointError(path, f"it is not a checkpoint written by autobatch's runner (format {expect_format} expected)")
    return state


#: The first bytes of a file ``torch.save`` writes (a zip archive), as every checkpoint is.
ZIP_MAGIC = b"PK\x03\x04"


def written_by_torch_save(path: Path) -> bool:
    """Whether ``path`` starts as a file ``torch.save`` writes (a zip archive); True where it
    cannot be read or is empty (loading it says why: an empty ``last.pt`` is one the runner wrote
    that a crash emptied, not a file of another kind)."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(len(ZIP_MAGIC))
    except OSError:
        return True
    return start == ZIP_MAGIC or not start


def _size(path: Path) -> int | None:
    """``path``'s size in bytes; None where it cannot be read (loading it says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        path, f"it is truncated or not a torch checkpoint ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}); "
        "resume from an earlier checkpoint or start afresh",
    )


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
