"""A persistent cache of probe results, keyed by everything that changes the answer.

Re-probing the same model in every sweep job and every restart is waste. A probe result is
stored as one JSON file per key in a directory: ``$AUTOBATCH_CACHE_DIR``, else
``$XDG_CACHE_HOME/autobatch``, else ``~/.cache/autobatch``; or a directory given to
``find_max_batch(cache=path)``.

The key is the SHA-256 of a canonical JSON of its components (stored in the file too, so
:func:`list_entries` can show what each entry is):

* ``model``: the module tree (qualified names and classes), parameter and buffer names,
  shapes, dtypes and ``requires_grad``; which modules are activation-checkpointed;
* ``compiled``: how each compiled module was compiled (backend, mode's options, ``dynamic``,
  ``fullgraph``), present only where one is;
* ``code``: a hash of the code of the loss function, of ``make_batch`` and of every module
  class's ``forward`` with the values it reads (:mod:`~autobatch.probe.caching.cache_key`);
* ``inputs``: the structure, shapes and dtypes of ``make_batch(1)`` and ``make_batch(2)``
  (built with fake tensors, so nothing is allocated);
* ``optimizer``: its class (module, qualified name, a user class's code), the parameters each
  group trains, and the hyperparameters that change its state or temporaries (momentum on or
  off, ``amsgrad``, ``foreach``, ``fused``, ...; not the learning rate);
* ``precision``: the autocast dtype and the grad scaler;
* ``device``: its name and capacity (in 64 MiB steps, so a few MiB of driver noise do not
  miss), and the memory cap; the attention kernels switched on; on CUDA the allocator's settings
  and the kernel switches off their defaults (cuDNN off, deterministic algorithms); the torch and
  autobatch versions;
* ``probe``: the strategy and its parameters (``start``, ``max_batch``, ``margin``,
  ``multiple_of``, ``steps_per_trial``, ``search_steps``), and the allocator headroom a
  passing trial must leave on an accelerator (``autobatch.probe.ALLOCATOR_HEADROOM``).

A plain callable has no structure to key on; it is cached only under an explicit
``cache_key``. Writes are atomic (a temporary file, then ``os.replace``) under a file lock, so
concurrent sweep jobs never see half a file. A corrupt or foreign file, or an entry whose
result would be a wrong answer (a ``batch_size`` that is not a positive integer, a margin
outside [0, 1), ...: :func:`result_problem`), is reported once (a warning per path) and
treated as a miss: the probe runs and the entry is rewritten. Entries are made readable as the
umask allows (not ``mkstemp``'s 0600), so a cache a team shares serves everyone. A directory where the lock file
cannot be created (read-only, no permission, a path that is a file or lies under one: one warning, saying so,
where a read of the entry said "not readable JSON" too) is not waited on as if another process held the
lock: :meth:`ProbeCache.put` warns once per directory and does not cache;
:meth:`ProbeCache.clear` raises :class:`CacheLockError` at once. An entry that cannot be written
(a full disk) is warned about once per directory and cause.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from .cache_key import CAPACITY_STEP, STATE_HYPERPARAMETERS, key_components, key_of, step_components  # noqa: F401
from .cache_checks import result_problem
from ..result import STORED_NOTE, ProbeResult

__all__ = [
    "SCHEMA", "CacheEntry", "CacheLockError", "ProbeCache", "default_dir", "list_entries", "clear", "key_components",
    "key_of", "result_problem",
]  # fmt: skip

log = logging.getLogger("autobatch")

#: Version of the entry format; entries of another version are ignored (with a warning).
SCHEMA = 1
KIND = "autobatch.probe-result"

_warned: set[str] = set()


def default_dir() -> Path:
    """``$AUTOBATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/autobatch``, else ``~/.cache/autobatch``.
    A relative ``$XDG_CACHE_HOME`` is ignored, as the XDG base directory specification says: read
    from each job's working directory (a sweep's job directories, Hydra's ``chdir``), it made one
    cache per directory, and a probe cached in one was never found from another."""
    explicit = os.environ.get("AUTOBATCH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and Path(xdg).expanduser().is_absolute() else os.path.join("~", ".cache")
    return Path(base).expanduser() / "autobatch"


class CacheLockError(OSError):
    """The cache directory's lock file cannot be created or opened (a read-only directory, no
    permission, a filesystem that refuses it): not another process holding the lock, so
    nothing is gained by waiting for it."""


# -- the store ------------------------------------------------------------------------------
@dataclass
class CacheEntry:
    """One cached probe result, as :func:`list_entries` shows it."""

    key: str
    path: Path
    created: str
    batch_size: int
    device: str
    components: dict[str, Any]


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("ignoring probe cache file %s: %s", path, why)


def _warn_unlockable_once(directory: Path, exc: CacheLockError) -> None:
    """One warning per directory whose lock file cannot be created: every probe would say it."""
    if f"lock:{directory}" not in _warned:
        _warned.add(f"lock:{directory}")
        log.warning("%s; probe results are not cached there (choose a writable cache directory: $AUTOBATCH_CACHE_DIR, "
                    "cache=path, or cache=False)", exc)


def _warn_unwritable_once(directory: Path, path: Path, exc: Exception) -> None:
    """One warning per directory and cause for an entry that cannot be written (a full disk, a
    quota): a plan's or a sweep's every probe in this process would say it again."""
    cause = getattr(exc, "errno", None) or type(exc).__name__
    if f"write:{directory}:{cause}" not in _warned:
        _warned.add(f"write:{directory}:{cause}")
        log.warning("could not write the probe cache entry %s: %s; probe results are not cached there until it "
                    "can be written (free space, or choose another cache directory: $AUTOBATCH_CACHE_DIR, "
                    "cache=path, or cache=False)", path, exc)


class ProbeCache:
    """The cache directory: :meth:`get` and :meth:`put` probe results by key."""

    LOCK_NAME = ".lock"

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        if isinstance(directory, str) and not directory.strip():  # Path("") is the working directory
            raise ValueError(f"cache={directory!r} names no directory (an unset setting?): pass cache=True for the "
                             f"default directory ({default_dir()}), a directory path, or cache=False")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):  # else pathlib's bare TypeError
            raise TypeError(f"the cache directory must be a str or Path (or None: {default_dir()}), got "
                            f"{type(directory).__name__} {directory!r:.40}")
        self.directory = Path(directory).expanduser() if directory is not None else default_dir()

    def path_of(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _lock(self) -> FileLock:
        """The directory's lock (waits up to 60 s for another process). A lock file that
        cannot be created raises :class:`CacheLockError` at once: filelock would retry that
        error for the whole timeout and then report it as if another process held the lock."""
        lock_path = self.directory / self.LOCK_NAME
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.close(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666))
        except OSError as exc:
            why = exc.strerror or str(exc)
            if isinstance(exc, (FileExistsError, NotADirectoryError)):  # cache="result.json": a file, not a directory
                why += f"; {self.directory} is a file or lies under one, and the cache is a directory: name a directory"
            error = CacheLockError(f"cannot create the probe cache lock file {lock_path} ({why})")
            error.errno = exc.errno
            raise error from exc
        return FileLock(str(lock_path), timeout=60)

    def _read(self, path: Path) -> dict[str, Any] | None:
        """The entry in ``path``, or None (with one warning per path) when it is not ours."""
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # no entry; a directory that is a file: put() says so
            return None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # (a file of "[[[[...")
            _warn_once(path, f"not readable JSON ({type(exc).__name__}: {exc})")
            return None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            _warn_once(path, "not an autobatch probe-cache entry")
            return None
        if data.get("schema") != SCHEMA:
            age = "an older" if isinstance(data.get("schema"), int) and data["schema"] < SCHEMA else "another"
            _warn_once(path, f"schema {data.get('schema')!r}, this autobatch reads {SCHEMA} (written by {age} "
                             f"autobatch; `python -m autobatch cache clear --dir {path.parent}` deletes it)")
            return None
        if not isinstance(data.get("components"), dict):
            _warn_once(path, "its components are not an object")
            return None
        if data.get("key") != path.stem:
            _warn_once(path, "its key does not match its file name")
            return None
        try:
            problem = result_problem(ProbeResult.from_dict(data["result"]))
        except Exception as exc:  # noqa: BLE001 - any malformed result is a miss
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            _warn_once(path, f"malformed result ({problem})")
            return None
        return data

    def get(self, key: str) -> ProbeResult | None:
        """The cached result for ``key`` (marked ``cached``), or None on a miss."""
        try:
            data = self._read(self.path_of(key))
        except OSError as exc:
            _warn_once(self.path_of(key), f"{type(exc).__name__}: {exc}")
            return None
        if data is None:
            return None
        result = ProbeResult.from_dict(data["result"])
        result.cached = True
        # its notes tell how the storing probe found the answer, not what this call did
        result.notes = [note if note.startswith(STORED_NOTE) else STORED_NOTE + note for note in result.notes]
        # which entry, from when and what it saved: the hit's own time is the look-up's (a summary
        # said "cached" and "0.01 s", never that the answer was a week old or what the probe took)
        created = data.get("created")
        stored = f", stored {created}" if isinstance(created, str) and created else ""
        result.notes.append(f"from the probe cache ({self.path_of(key)}{stored} by a probe of {result.elapsed_s:.2f} s); "
                            "no trial ran")
        return result

    def put(self, key: str, components: dict[str, Any], result: ProbeResult) -> Path | None:
        """Store ``result`` under ``key`` atomically; a failure to write is logged, not raised."""
        entry = {
            "schema": SCHEMA,
            "kind": KIND,
            "key": key,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "components": components,
            "result": result.to_dict(),
        }
        text = json.dumps(entry, indent=1, default=str)
        path = self.path_of(key)
        try:
            with self._lock():
                handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
                try:
                    # mkstemp's 0600 would hide the entry from the others sharing the directory
                    if hasattr(os, "fchmod"):
                        os.fchmod(handle, 0o666 & ~_umask())
                    with os.fdopen(handle, "w") as out:
                        out.write(text)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(temporary, path)
                except BaseException:
                    os.unlink(temporary)
                    raise
        except CacheLockError as exc:
            _warn_unlockable_once(self.directory, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is no reason to fail
            _warn_unwritable_once(self.directory, path, exc)
            return None
        return path

    def entries(self) -> list[CacheEntry]:
        """Every valid entry, oldest first (invalid files are warned about once, and skipped)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in sorted(self.directory.glob("*.json")):
            if path.name.startswith(".tmp-"):
                continue
            data = self._read(path)
            if data is None:
                continue
            found.append(
                CacheEntry(
                    key=data["key"],
                    path=path,
                    created=str(data.get("created", "")),
                    batch_size=int(data["result"]["batch_size"]),
                    device=str(data["result"].get("device", "")),
                    components=data["components"],
                )
            )
        return sorted(found, key=lambda entry: entry.created)

    def clear(self) -> int:
        """Delete every entry, of this schema or an older one, and the temporary files writers
        abandoned (:func:`_abandoned_temporary`); return how many entries went. A file named as an
        entry is (``<64 hex digits>.json``) goes too, even when it cannot be read (torn, corrupt, no
        read permission): the probe skips it with a warning every time, and ``clear`` is how to be
        rid of it. Any other file, JSON or not, stays, a ``.tmp-*.json`` of another program or one
        a writer may still be writing too: ``--dir`` may name a directory that holds more than the
        cache. A lock file that cannot be created raises :class:`CacheLockError`; a file that
        cannot be deleted, its ``OSError``."""
        if not self.directory.is_dir():
            return 0
        removed = 0
        with self._lock():
            for path in self.directory.glob("*.json"):
                temporary = path.name.startswith(".tmp-")
                if temporary and not _abandoned_temporary(path):
                    continue
                if not temporary and not _ENTRY_NAME.fullmatch(path.name) and not _is_entry(path):
                    continue
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed += not temporary
        return removed


def _umask() -> int:
    """The process's umask (the kernel's record where there is one: setting it to read it
    back is not thread-safe)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: The name of an entry's file: its key, a SHA-256 digest in hex.
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")


def _is_entry(path: Path) -> bool:
    """Whether ``path`` holds a probe-cache entry (any schema): the only files ``clear`` deletes."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("kind") == KIND


#: The name :meth:`ProbeCache.put`'s ``mkstemp`` gives a temporary: ``.tmp-``, 8 characters, ``.json``.
_TEMPORARY_NAME = re.compile(r"\.tmp-[a-z0-9_]{8}\.json")
#: A temporary untouched this long is abandoned: a writer holds one for the milliseconds between
#: ``mkstemp`` and ``os.replace`` (under the lock, which ``clear`` holds too; the age is for a writer
#: whose lock does not reach this one, another host's on a filesystem without shared locks).
ABANDONED_AFTER_S = 600


def _abandoned_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary of :meth:`ProbeCache.put` that its writer abandoned (killed
    between writing it and renaming it into place): ``mkstemp``'s name, untouched for
    :data:`ABANDONED_AFTER_S`, empty or the start of an entry's text. ``clear`` deleted every
    ``.tmp-*.json`` before: another program's temporary (``--dir`` may name a directory that holds
    more than the cache), or one a writer was still writing, which then failed to rename it."""
    if not _TEMPORARY_NAME.fullmatch(path.name):
        return False
    try:
        if time.time() - path.stat().st_mtime < ABANDONED_AFTER_S:
            return False
        with open(path, "rb") as handle:
            head = handle.read(80).decode("utf-8", "replace")
    except OSError:
        return False
    schema = re.match(r'\{\n "schema": (\d+)', head)
    opening = f'{{\n "schema": {schema.group(1) if schema else SCHEMA},\n "kind": "{KIND}"'  # as put() writes it
    return opening.startswith(head) or head.startswith(opening)


def list_entries(directory: str | os.PathLike | None = None) -> list[CacheEntry]:
    """The valid entries of the cache in ``directory`` (default :func:`default_dir`)."""
    return ProbeCache(directory).entries()


def clear(directory: str | os.PathLike | None = None) -> int:
    """Delete the entries of the cache in ``directory`` (default :func:`default_dir`); return
    how many were deleted."""
    return ProbeCache(directory).clear()
