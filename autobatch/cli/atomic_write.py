"""Text files the command line writes whole or not at all.

A run's records (``result.json``, ``plan.json``, ``train_result.json``), a resumed run's kept
``metrics.jsonl`` lines and a sweep's summaries are written to a temporary file beside the
target and renamed over it (``os.replace``, atomic on POSIX and Windows): a write that fails
part-way (a full disk, a kill) or a parallel sweep job never leaves a torn file where an
earlier one was, and the temporary is removed where the write raised.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` through ``.<name>.tmp-<pid>`` and a rename; with ``fsync``, the
    bytes reach the disk before the rename (a file the run goes on appending to)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
