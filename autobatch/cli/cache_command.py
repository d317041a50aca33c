"""``python -m autobatch cache list|clear [--dir DIR]``: show or empty the probe cache.

Not a Hydra app (there is nothing to configure): plain argparse, called by the dispatcher.
The directory is ``--dir``, else the one the probe uses by default
(:func:`autobatch.cache.default_dir`: ``$AUTOBATCH_CACHE_DIR``, ``$XDG_CACHE_HOME/autobatch``
or ``~/.cache/autobatch``); a probe run with ``probe.cache_dir=DIR`` is listed with ``--dir DIR``.

``cache list`` skips a malformed entry with one warning naming the file (the probe treats it
as a miss); ``cache clear`` deletes it with the valid ones. A default directory that is a file
(``AUTOBATCH_CACHE_DIR`` pointing at one) is one error, as a ``--dir`` that is one is. ``cache clear`` on a directory it cannot lock or delete from (read-only, no
permission) fails at once with one ``autobatch: error:`` line naming the directory and the
cause, exit status 1 (a failure at run time, as in :mod:`autobatch.cli.errors`); so does a
lock another process held for the whole 60 s wait.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from filelock import Timeout

from ..memory.units import counted
from ..probe.caching.cache import CacheEntry, CacheLockError, ProbeCache, default_dir
from .errors import RUNTIME_FAILURE, CLIError
from .schema_keys import close_match

__all__ = ["main", "entry_table"]

KEY_PREFIX = 12
ACTIONS = ("list", "clear")


def _model(entry: CacheEntry) -> str:
    """The root module's class (and the autocast dtype, when there is one); ``?`` where the entry's
    components do not say (a plain callable's, or a hand-edited file's: its result may still be
    served, so the listing shows it rather than failing with a traceback)."""
    model, precision = entry.components.get("model"), entry.components.get("precision")
    modules = model.get("modules") if isinstance(model, dict) else None
    root = modules[0] if isinstance(modules, list) and modules else None
    name = str(root[1]) if isinstance(root, list) and len(root) > 1 else "?"
    autocast = precision.get("autocast") if isinstance(precision, dict) else None
    return f"{name} ({autocast.replace('torch.', '')})" if isinstance(autocast, str) and autocast else name


def entry_table(entries: list[CacheEntry]) -> str:
    """A plain-text table: key prefix, model, device, batch size, created."""
    rows = [("key", "model", "device", "batch size", "created")]
    rows += [(e.key[:KEY_PREFIX], _model(e), e.device, str(e.batch_size), e.created) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input is one :class:`CLIError` line (the dispatcher prints it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CLIError(f"cache: {message}; usage: python -m autobatch cache list|clear [--dir DIR]")


def _directory(text: str) -> Path:
    """``--dir``'s value, ``~`` expanded as ``probe.cache_dir``'s is (the shell leaves ``--dir=~/x`` as it is);
    an empty one (an unset shell variable) is refused: ``Path("")`` would clear the working directory's entries."""
    if not text.strip():
        raise argparse.ArgumentTypeError("it names no directory (empty); give the cache directory, or leave --dir out for the default")
    return Path(text).expanduser()


def _action(text: str) -> str:
    """The action, or one line with the closest of ``list`` / ``clear`` for a misspelt one (``cache lst``)."""
    if text not in ACTIONS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(ACTIONS)})"
                                         f"{close_match(text, ACTIONS, 'cache ')}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m autobatch cache",
        description="Show or empty the persistent probe cache (probe.cache=true stores every probe result there).",
    )
    parser.add_argument("action", type=_action, choices=ACTIONS, help="list the entries, or delete them all")
    parser.add_argument("--dir", type=_directory, default=None, help=f"the cache directory (default: {default_dir()})")
    return parser


def _check_dir(action: str, directory: Path) -> None:
    """A ``--dir`` given explicitly must be a directory: a typo or a file would otherwise list
    (or clear) nothing and say "0 entries" as if the cache were empty."""
    if directory.is_dir():
        return
    what = "is a file, not a directory" if directory.exists() else "does not exist"
    raise CLIError(f"cache {action} --dir {directory}: {what}; give the cache directory (a probe's probe.cache_dir)")


def _default_source() -> str:
    """The variable that chose the default cache directory, for a message."""
    if os.environ.get("AUTOBATCH_CACHE_DIR"):
        return "AUTOBATCH_CACHE_DIR"
    return "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "the cache directory (~/.cache/autobatch)"


def _clear(store: ProbeCache) -> int:
    """``store.clear()``, its failures as one :class:`CLIError` line naming the directory."""
    try:
        return store.clear()
    except CacheLockError as exc:
        why = f"{exc}; make it writable or give another with --dir"
    except Timeout:
        why = "another process held its lock for 60 s (a probe writing to it?); try again when it is done"
    except OSError as exc:
        why = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "") + "; make it writable"
    raise CLIError(f"cache clear: cannot clear {store.directory}: {why}", RUNTIME_FAILURE)


def main(argv: Sequence[str]) -> int:
    """Run ``cache list`` or ``cache clear``; return the exit status. Bad input raises
    :class:`CLIError`; ``--help`` prints the help and exits 0."""
    args = _parser().parse_args(list(argv))
    if args.dir is not None:
        _check_dir(args.action, args.dir)
    elif default_dir().exists() and not default_dir().is_dir():  # a missing default is an empty cache
        raise CLIError(f"cache {args.action}: the cache directory {default_dir()} is a file, not a directory; point "
                       f"{_default_source()} at a directory (or give --dir DIR)")
    store = ProbeCache(args.dir)
    if args.action == "clear":
        removed = _clear(store)
        print(f"removed {counted(removed, 'entry', 'entries')} from {store.directory}")
        return 0
    entries = store.entries()
    print(f"probe cache {store.directory}: {counted(len(entries), 'entry', 'entries')}")
    if entries:
        print(entry_table(entries))
    return 0
