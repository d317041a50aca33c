"""The package version, in a module of its own so that any layer can read it without
importing the package's public surface (the probe cache keys answers by it), and a fingerprint of
the package's code (:func:`code_fingerprint`), which the cache keys them by too."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["__version__", "code_fingerprint"]

__version__ = "0.1.0"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A short hash of every ``.py`` file of the installed package (names and contents).

    Why: a cached probe answer is only as good as the code that found it, and the version number
    changes only at a release: with a checkout or an editable install, an answer an older commit
    cached (its trials, its notes, its rules for what passes) came back as a cache hit after the
    probe's code had changed. Read once per process (about 300 small files)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
