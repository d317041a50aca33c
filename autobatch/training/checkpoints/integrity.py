"""A checkpoint whose bytes were damaged after it was written is refused before anything in it is used.

``torch.save`` writes a zip archive holding a CRC32 of every entry (the pickle ``data.pkl``, each
tensor's bytes ``data/<n>``), and ``torch.load`` checks none of them: a ``last.pt`` with bytes
overwritten in its middle (a failing disk, a copy patched or cut and joined, a sync tool) loaded,
and a resume trained on from silently wrong weights (NaN from the next step), or failed with a
message about "objects that could run code" (a changed byte in ``data.pkl``) or ``OSError:
[Errno 22] Invalid argument`` (a file cut short). :func:`check_intact` reads every entry and
checks its CRC (``zipfile.ZipFile.testzip``) first, and raises one
:class:`~autobatch.errors.CheckpointError` naming the file, the damaged entry and the earlier
checkpoint kept beside it, if any (:func:`earlier_kept`: ``last.earlier-<n>.pt``, moved aside by
a later run's first save, each one checked the same way before it is named). The damaged file is
never changed, moved or removed.

Cost: one extra read of the file, about 0.13 s per 100 MB on a warm page cache (torch.load of the
same file: 0.09 to 0.2 s). A file checked once is not checked again in this process while its
inode, size and modification time stay the same (the command line reads a checkpoint twice:
what run it belongs to, then the resume).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from ...errors import CheckpointError

__all__ = ["check_intact", "earlier_kept"]

#: files found whole in this process: path -> (inode, size, modification time in ns)
_CHECKED: dict[str, tuple[int, int, int]] = {}
_SHARD = re.compile(r"^(?P<stem>.+?)(?P<rank>\.rank\d+-of-\d+)?$")


def _mark(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def check_intact(path: Path) -> None:
    """Raise a :class:`CheckpointError` where ``path`` (a zip archive ``torch.save`` wrote) is cut
    short or an entry's bytes no longer match the CRC32 written with them; an ``OSError`` reading it
    propagates (the caller names the file)."""
    key, mark = str(path.resolve()), _mark(path)
    if _CHECKED.get(key) == mark:
        return
    try:
        bad = _first_damaged(path)
    except zipfile.BadZipFile as exc:  # no central directory at its end (cut short), or a header overwritten
        problem = ("it is cut short: the end of the file, where the zip archive torch.save writes lists its "
                   "entries, is missing" if "not a zip file" in str(exc).lower()
                   else f"its zip archive is damaged ({' '.join(str(exc).split())[:120]})")
        raise CheckpointError(path, f"{problem} (a copy or download cut short, a disk error){_what_to_do(path)}") from None
    if bad is not None:
        raise CheckpointError(
            path, f"it is damaged: the bytes of its entry {bad!r} are not those torch.save wrote (their CRC32 "
            "does not match; a disk error, or a copy or sync that changed the file), so the weights or the state in "
            f"it are wrong and nothing of it is loaded{_what_to_do(path)}")
    _CHECKED[key] = mark


def _first_damaged(path: Path) -> str | None:
    """The first entry of ``path``'s zip archive whose bytes fail their CRC32, or None (every entry is
    read); ``zipfile.BadZipFile`` where the archive itself is cut or broken."""
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()


def _what_to_do(path: Path) -> str:
    """What to resume from instead: the newest earlier checkpoint kept beside ``path`` that is
    whole, else start afresh. The damaged file is left as it is, for the user to inspect."""
    kept = earlier_kept(path)
    if kept is None:
        return (". The file is left as it is. Restore it from a backup or a good copy, or start afresh "
                "(fit(..., resume=None); on the command line, without train.resume): no earlier checkpoint is kept "
                "beside it (each save of a run replaces last.pt)")
    return (f". The file is left as it is. Restore it from a backup or a good copy, or resume from {kept}, the newest "
            "whole checkpoint kept beside it (an earlier run's, moved aside when a run started afresh there: check it "
            f"is the run to continue; fit(..., resume={str(kept)!r}), on the command line train.resume={kept}), or "
            "start afresh")


def earlier_kept(path: Path) -> Path | None:
    """The newest ``<stem>.earlier-<n>.pt`` beside ``path`` (a sharded rank file's own:
    ``last.earlier-<n>.rank<r>-of-<w>.pt``) that is whole; None where there is none."""
    match = _SHARD.match(path.stem)
    if match is None:
        return None
    stem, rank = match["stem"], match["rank"] or ""
    pattern = re.compile(rf"^{re.escape(stem)}\.earlier-(\d+){re.escape(rank)}{re.escape(path.suffix)}$")
    try:
        found = [(int(m[1]), p) for p in path.parent.iterdir() if (m := pattern.match(p.name))]
    except OSError:
        return None
    for _, candidate in sorted(found, reverse=True)[:3]:  # a few at most: this runs on an error's path
        try:
            if _first_damaged(candidate) is None:
                return candidate
        except (OSError, zipfile.BadZipFile):
            continue
    return None
