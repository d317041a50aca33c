"""``python -m autobatch <command> [overrides]`` (and the ``autobatch`` console script).

Hydra has no subcommands, so this small dispatcher takes the first argument as the command
(``probe`` or ``train``), checks the rest (:mod:`autobatch.cli.preflight`), and hands them
to that command's Hydra app as its ``sys.argv``. ``--help`` lists the commands;
``python -m autobatch probe --help`` is Hydra's help for one of them. ``cache list|clear``
is not a Hydra app: plain argparse (:mod:`autobatch.cli.cache_command`). ``--version``, alone
or after a command, prints autobatch's version (Hydra's own flag would print Hydra's). A
Ctrl-C outside training ends the command with one line and exit status 130 (``train`` saves
its progress first: :mod:`autobatch.cli.interrupt`).
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Any, Sequence

USAGE = """\
usage: python -m autobatch <command> [--multirun|-m] [key=value ...] [hydra flags]
       python -m autobatch --version

Find the largest batch size that trains in memory, from the command line (Hydra configs).

commands:
{commands}

examples:
  python -m autobatch probe                                  # default model, any machine
  python -m autobatch probe model=cnn probe.memory_limit=256MiB
  python -m autobatch probe train.global_batch=512          # and the plan for that global batch
  python -m autobatch train model=mlp train.steps=100 train.global_batch=256 train.checkpoint_every=20
  python -m autobatch train train.resume=latest              # continue the newest run's checkpoint
  python -m autobatch cache list                             # the probe cache (cache clear: empty it)
  python -m autobatch probe -m model=mlp,gpt probe.strategy=binary,halving   # a sweep + summary
  python -m autobatch train --config-dir myconf --config-name mytrain   # your own config (defaults: [train, _self_])

`python -m autobatch <command> --help` shows that command's config groups and options.
Set AUTOBATCH_TRACEBACK=1 (or HYDRA_FULL_ERROR=1) for full tracebacks on errors."""


CACHE_TEXT = "list or clear the persistent probe cache: cache list|clear [--dir DIR]"


def _usage() -> str:
    from .cli.commands import COMMANDS

    lines = [f"  {name:<7} {text}" for name, (_, _, text) in COMMANDS.items()]
    lines.append(f"  {'cache':<7} {CACHE_TEXT}")
    return USAGE.format(commands="\n".join(lines))


#: Commands people reach for that are part of another: the hint names where it lives.
MOVED = {"plan": "the plan is part of probe: python -m autobatch probe train.global_batch=N (writes plan.json)"}


def _fail(message: str, code: int = 2) -> int:
    print(f"autobatch: error: {message}", file=sys.stderr)
    return code


def _version() -> str:
    """``autobatch <version>``, the installed distribution's when there is one (else the source's)."""
    from importlib import metadata

    from .version import __version__

    try:
        version = metadata.version("autobatch")
    except metadata.PackageNotFoundError:
        version = __version__
    return f"autobatch {version}"


class _ClosedPipeQuiet:
    """``sys.stdout`` for one command: once the reader of a pipe has gone (``... | head -3``),
    the rest of the output goes to ``os.devnull`` instead of ending in a ``BrokenPipeError``
    traceback (Python docs, "Note on SIGPIPE": point stdout at devnull). The error is caught
    here, where it is raised, because Hydra prints its help and ``--cfg`` inside its own error
    reporter, which turned it into a traceback; and a command that lost its reader still ends
    as it would (a probe still writes result.json and the cache, a training run its
    checkpoint), with its own exit status. SIGPIPE's default action is not restored, which the
    docs advise against: it would also end the process on a closed socket (torchrun's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.pipe_closed = False

    def _closed(self) -> None:
        """The reader is gone: point the file descriptor at devnull (for a logging handler or the
        interpreter's exit flush that write to it) and drop this stream's output from now on."""
        self.pipe_closed = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
            self._stream.flush()  # what was buffered goes to devnull now
        except (OSError, ValueError, AttributeError):  # no descriptor (a captured stream): nothing holds one
            pass

    def write(self, text: str) -> int:
        if not self.pipe_closed:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._closed()
        return len(text)

    def flush(self) -> None:
        if not self.pipe_closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._closed()

    def __getattr__(self, name: str) -> Any:  # isatty(), fileno(), encoding, ...: the stream's own
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command's Hydra app; return the exit status. Output to a pipe whose reader
    has gone (``python -m autobatch --help | head -3``) ends quietly (:class:`_ClosedPipeQuiet`)."""
    original = sys.stdout
    if original is None or isinstance(original, _ClosedPipeQuiet):
        return _dispatch(argv)
    sys.stdout = guard = _ClosedPipeQuiet(original)
    try:
        code = _dispatch(argv)
        guard.flush()
        return code
    finally:
        if sys.stdout is guard:
            sys.stdout = original


def _dispatch(argv: Sequence[str] | None) -> int:
    """:func:`main` 's work: the command's Hydra app, ``cache``, ``--help`` or ``--version``."""
    _import_from_working_directory()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] != "cache" and "--version" in args:
        print(_version())
        return 0
    from .cli import errors, preflight
    from .cli.commands import COMMANDS, run_app

    command, rest = args[0], args[1:]
    if command in MOVED:
        return _fail(f"unknown command {command!r}; {MOVED[command]}")
    if command == "cache":
        from .cli.cache_command import main as cache_main

        try:
            return cache_main(rest)
        except errors.CLIError as exc:
            return _fail(exc.message, exc.exit_code)
    if command not in COMMANDS:
        known = [*COMMANDS, "cache"]
        close = difflib.get_close_matches(command, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return _fail(f"unknown command {command!r}; {hint}choose one of: {', '.join(known)} (python -m autobatch --help)")
    try:
        preflight.check(command, rest)
    except errors.CLIError as exc:
        if errors.traceback_wanted(_verbose(rest)):
            raise
        return _fail(exc.message, exc.exit_code)
    from .cli.ranks import hydra_overrides

    sys.argv = [f"autobatch {command}", *rest, *hydra_overrides(rest)]  # under torchrun, ranks > 0 stay out of the run dir
    try:
        run_app(command)
    except KeyboardInterrupt as exc:  # outside training (which saves and exits 130 itself): no traceback
        if errors.traceback_wanted(_verbose(rest)):
            raise
        from .cli.job_signals import exit_code

        _report_sweep()
        if os.environ.get(errors.ERROR_FILE_ENV):  # train's probe child: the parent, interrupted too, says it once
            return exit_code(exc)
        return _fail("interrupted", exit_code(exc))
    except SystemExit as exc:
        _report_sweep()
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    _report_sweep()
    return 0


def _import_from_working_directory() -> None:
    """Put the working directory first on ``sys.path`` where it is missing, as ``python -m``
    does: the ``autobatch`` console script (``sys.path[0]`` its own bin folder) could not import
    a ``_target_`` in the user's ``mymodels.py`` beside the command, which ``python -m autobatch``
    could, though the docs call them the same program."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)


def _verbose(args: Sequence[str]) -> bool:
    """Whether the overrides turn on ``hydra.verbose`` (true, or a list of loggers)."""
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(("hydra.verbose=", "++hydra.verbose="))]
    return bool(values) and values[-1].strip() not in ("", "false", "False", "null", "[]")


def _report_sweep() -> None:
    """After a multirun, print its summary table (also written as summary.md/summary.csv)."""
    from .cli.sweep import last_sweep_dir, write_summary
    from .memory.units import counted

    sweep_dir = last_sweep_dir()
    if sweep_dir is None or not sweep_dir.is_dir():
        return
    rows = write_summary(sweep_dir, plot=False)  # the callback drew summary.png (unless probe.plot=false)
    if not rows:
        return
    print()
    print((sweep_dir / "summary.md").read_text(encoding="utf-8"), end="")
    statuses = [row.get("status") for row in rows]
    failed, stopped = sum(status not in ("ok", "interrupted") for status in statuses), statuses.count("interrupted")
    plot = " and summary.png" if (sweep_dir / "summary.png").is_file() else ""
    interrupted = f", {stopped} interrupted (their rows say how to continue)" if stopped else ""
    print(f"{counted(len(rows), 'job')}, {failed} failed{interrupted}; summary: {sweep_dir / 'summary.md'}, summary.csv{plot}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
