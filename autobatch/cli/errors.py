"""Bad input and failures at the command line's edge: one line naming what to fix, an exit code.

Every exception that reaches the edge becomes ``autobatch: error: <one line>`` on stderr and
exit status 2 for bad input (a wrong override, impossible probe bounds, an unimportable
``_target_``) or 1 for a failure at run time (nothing fits, an error in the model). Set
``AUTOBATCH_TRACEBACK=1`` (or ``HYDRA_FULL_ERROR=1``, or ``hydra.verbose=true``) for the full traceback instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
import sysconfig
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

from hydra.errors import CompactHydraException, HydraException, OverrideParseException
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from .interpolations import unresolved_line
from ..errors import GlobalBatchTooLargeError, NoBatchFitsError, StepOutOfMemoryError, in_packages, raised_through
from ..probe.foreach import FOREACH_ADVICE

__all__ = [
    "CLIError", "BAD_INPUT", "RUNTIME_FAILURE", "ERROR_FILE_ENV", "one_line", "cli_keys", "describe", "traceback_wanted",
    "reported", "hydra_noise_filtered", "handed_back", "where_raised", "log_to_files",
]  # fmt: skip

BAD_INPUT = 2
RUNTIME_FAILURE = 1
PREFIX = "autobatch: error: "
#: Set by a parent process to a file: the command writes its error there (``{"message", "code"}``)
#: instead of printing it, and the parent reports it as its own (``train``'s probe in a child
#: process, :mod:`autobatch.cli.isolated`): one line, and a sweep's summary names the real error.
ERROR_FILE_ENV = "AUTOBATCH_ERROR_FILE"
_NOISE = ("full_key:", "object_type=", "reference_type=", "Set the environment variable HYDRA_FULL_ERROR")
#: What Hydra itself writes to stderr around a failed job of a sweep (each in one write):
#: the job's overrides each time a failed job's result is read, and how to get its traceback
#: (here ``AUTOBATCH_TRACEBACK=1``). The summary table and the ``autobatch: error:`` line say it.
_HYDRA_STDERR_NOISE = ("Error executing job with overrides:", "Set the environment variable HYDRA_FULL_ERROR")


class CLIError(CompactHydraException):
    """An error already phrased for the user. Hydra prints a ``CompactHydraException`` as its
    message alone (no traceback), which is what a failed job of a sweep needs."""

    def __init__(self, message: str, exit_code: int = BAD_INPUT, job: str = "") -> None:
        super().__init__(PREFIX + (f"{job}: " if job else "") + message)
        self.message = message  # without ``job``: a sweep's summary row is the job's already
        self.exit_code = exit_code
        self.job = job

    def __reduce__(self):  # launchers such as joblib pickle a failed job's exception
        return type(self), (self.message, self.exit_code, self.job)


#: The longest one-line error; a longer one loses its middle (:func:`_shortened`).
MAX_LINE = 600


def one_line(exc: BaseException) -> str:
    """The exception's message on one line, without OmegaConf's ``full_key`` bookkeeping."""
    return _shortened(_joined(str(exc)) or type(exc).__name__)


def _joined(message: str) -> str:
    """``message``'s lines as one, without OmegaConf's bookkeeping and Hydra's search path."""
    kept = []
    for line in (line.strip() for line in message.splitlines()):
        if line.startswith("Config search path"):  # Hydra's "could not find" lists its search path
            break
        if line and not line.startswith(_NOISE):
            kept.append(line)
    return " ".join(kept)


def _shortened(text: str) -> str:
    """A long message loses its middle, not its end: the advice (what to change) comes last."""
    return text if len(text) <= MAX_LINE else text[:397] + " ... " + text[-198:]


def _out_of_memory(exc: BaseException) -> str:
    """The line of an out-of-memory failure (no batch fits, a global batch too large, a step that
    gave up), with its argument names as the command line's keys. A ``NoBatchFitsError`` ends
    with the allocator's own message, after the advice; a long one (CUDA's runs to 500
    characters) cut the line's middle, the advice with it (``a larger probe.memory_limit``), and
    kept the allocator's closing words. Where the line would be too long, the allocator's message
    is left to the traceback, which ``AUTOBATCH_TRACEBACK=1`` shows."""
    text, notes = _joined(str(exc)), _notes(exc)
    last = getattr(exc, "last_error", None)
    tail = f" Last allocator error: {_joined(str(last))}" if last else ""
    if tail and text.endswith(tail) and len(text) + len(notes) > MAX_LINE:
        text = text[: -len(tail)] + " (the allocator's own message: AUTOBATCH_TRACEBACK=1)"
    if FOREACH_ADVICE in text and len(text) > MAX_LINE:  # the note sits mid-line, which a long line loses
        notes = f"; {_FOREACH_LINE}{notes}"
    return cli_keys(_shortened(text)) + notes


#: The library's argument names in its messages, and the command line's keys for them.
_CLI_KEYS = [
    (r"allow_accumulation=True", "plan.allow_accumulation=true"),
    (r"allow_checkpointing=True", "plan.allow_checkpointing=true"),
    (r"allow activation checkpointing(?= ?[.,])", "allow activation checkpointing (plan.allow_checkpointing=true)"),
    (r"checkpointing_fallback=True", "train.checkpointing_fallback=true"),
    (r"min_micro_batch", "train.min_micro_batch"),
    (r"checkpoint_targets", "plan.checkpoint_modules"),
    (r"memory_limit", "probe.memory_limit"),
    (r"global_batch=", "train.global_batch="),
    (r"autobatch\.plan(?!\w)", "train.global_batch"),  # not autobatch.planning
]
#: Launcher plugins, the package of each and the checkout's extra that installs it (``pip install -e
#: ".[extra]"``; ``autobatch`` on the package registry is another project, so no ``autobatch[extra]``).
_LAUNCHER_EXTRAS = {"submitit_": ("hydra-submitit-launcher", "slurm"), "slurm": ("hydra-submitit-launcher", "slurm"),
                    "joblib": ("hydra-joblib-launcher", "sweep")}


#: The library's advice in its notes (``exc.add_note``), as the command line's keys; first, as
#: :data:`_CLI_KEYS` would otherwise rename the argument inside the call.
_CLI_ADVICE = [
    (r"Pass multiple_of(=\d+)? \(to find_max_batch or plan\(\), or in a Runner's plan_options\)", r"Set probe.multiple_of\1"),
    (r"pass multiple_of(=\d+)? \(to find_max_batch or plan\(\), or in a Runner's plan_options\)", r"set probe.multiple_of\1"),
    (r"pass Runner\(min_micro_batch=(\d+)\)", r"set train.min_micro_batch=\1"),
    (r"\(strategy='binary', or 'auto' with estimate_first=False\)", "(probe.strategy=binary)"),
    (r"Pass strategy='auto' (.*?) start( or | \(at most )max_batch", r"Set probe.strategy=auto \1 probe.start\2probe.max_batch"),
    (FOREACH_ADVICE, "Set +optimizer.foreach=false"),  # probe.foreach's note: the optimizer's key
]
#: The foreach note (:func:`~autobatch.probe.foreach.foreach_note`) where the line is cut: in its own words
_FOREACH_LINE = ("the smallest batch ran out of memory inside optimizer.step(), in torch's foreach step, which no batch "
                 "size shrinks: set +optimizer.foreach=false (train switches it itself when it plans the micro-batch)")
#: Library notes that the command line says in its own words (the saved steps: its line names
#: the checkpoint and the command that continues the run).
_SAID_OTHERWISE = ("go on from there with fit(",)
#: Modules whose frames do not say where a user's error came from (the framework, Python, and
#: tenacity, the retry loop the runner calls the step through: "raised at .../tenacity/__init__.py").
_FRAMEWORK = ("torch", "hydra", "omegaconf", "importlib", "runpy", "tenacity")


def cli_keys(message: str) -> str:
    """A library message with its argument names as the command line's keys
    (``allow_accumulation=True`` -> ``plan.allow_accumulation=true``)."""
    for pattern, advice in _CLI_ADVICE:
        message = re.sub(pattern, advice, message)
    for name, key in _CLI_KEYS:
        message = re.sub(rf"(?<![\w.]){name}", key, message)
    return message


def _notes(exc: BaseException) -> str:
    """The library's notes on ``exc`` (``add_note``: which size a probe trial or a recovery failed
    at, and what to set), each on the same line as the command line's keys. ``str(exc)`` leaves
    them out: before, the CLI dropped the advice (``probe.multiple_of=2``) it was added for."""
    notes = [one_line(note) for note in getattr(exc, "__notes__", None) or () if isinstance(note, str)]
    kept = [cli_keys(note) for note in notes if note and not any(said in note for said in _SAID_OTHERWISE)]
    return "".join(f"; {note}" for note in kept)


def _raised_in_autobatch(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by autobatch, Hydra or OmegaConf (their checks of the config)
    rather than by the user's model, data or loss, or by torch on their behalf."""
    frames = raised_through(exc)
    return not frames or in_packages(frames[-1][0], ("autobatch", "hydra", "omegaconf"))


def where_raised(exc: BaseException, *, users_only: bool = False) -> str:
    """`` (raised at FILE:LINE, in FUNCTION; ...)`` for an error of the user's code: the innermost
    frame outside torch, Hydra and Python's own library (else outside autobatch's CLI, unless
    ``users_only``), so a bug in the model at run time says where it is; ``""`` where no frame says more."""
    paths = sysconfig.get_paths()
    installed = tuple(os.path.join(paths[name], "") for name in ("purelib", "platlib"))

    def python_own(filename: str) -> bool:  # the standard library, not the packages installed under it
        return filename.startswith(os.path.join(paths["stdlib"], "")) and not filename.startswith(installed)

    frames = [frame for frame in raised_through(exc, leaving=_FRAMEWORK) if not python_own(frame[1])]
    raiser = raised_through(exc)[-1:]  # the frame of the raise itself: torch's, when torch raised it
    if raiser and in_packages(raiser[0][0], ("autobatch.cli",)) and not users_only:
        return ""  # the command line's own check raised it (the loss's "not logits"): its words say what to change
    # else autobatch's frames that called torch (a built-in loss), not the simulated device's dispatch
    # mode, which every op on the CPU passes through: it named accounting.py for a target out of range
    users = [frame for frame in frames if not in_packages(frame[0], ("autobatch",))] or ([] if users_only else [
        frame for frame in frames if not in_packages(frame[0], ("autobatch.cli", "autobatch.__main__", "autobatch.memory"))])
    if not users:
        return ""
    _, filename, line, function = users[-1]
    return f" (raised at {filename}:{line}, in {function}; AUTOBATCH_TRACEBACK=1 for the traceback)"


def _install_hint(message: str) -> str:
    """An install hint when Hydra cannot find a launcher config that a plugin provides."""
    found = re.search(r"Could not (?:find|load) 'hydra/launcher/(\w+)'", message)
    if found is None:
        return message
    for prefix, (package, extra) in _LAUNCHER_EXTRAS.items():
        if found.group(1).startswith(prefix):
            return (f'{message.rstrip(".")}; the launcher is a plugin: pip install {package} (from the checkout: '
                    f'pip install -e ".[{extra}]")')
    return message


def _unparsed(exc: OverrideParseException) -> str:
    """An override Hydra's grammar cannot read, and the quoted form that it can. Hydra's own
    message (``LexerNoViableAltException: hydra.run.dir=runs/ü ^``) names neither the cause nor
    the fix: an unquoted value takes ASCII letters, digits, spaces and a few symbols only, so a
    path with an accented letter, a stray bracket or quote fails until the value is quoted."""
    override = str(getattr(exc, "override", "") or "")
    reason = one_line(exc).split(" See https://", 1)[0].removeprefix("LexerNoViableAltException: ")
    reason = reason.removeprefix(f"Error parsing override {override!r}").strip(" ^")
    reason = "" if reason in ("", override) else f" ({reason})"
    key, sep, value = override.partition("=")
    if not sep or not value or value[0] in "'\"" or value[-1] in "'\"":
        return f"cannot parse the override {override!r}{reason}; see Hydra's override grammar: {_GRAMMAR}"
    quote = "'" if '"' in value else '"'
    quoted = shlex.quote(f"{key}={quote}{value}{quote}")
    return (f"cannot parse the override {override!r}{reason}: unquoted, a value takes ASCII letters, digits "
            f"and a few symbols only (a list or dict needs its closing bracket); a string with other "
            f"characters (an accented letter, a bracket, a quote) is quoted inside the shell's quotes: {quoted}")


#: Hydra's page on its override grammar (quoting, lists, sweeps).
_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _keyed(exc: OmegaConfBaseException) -> str:
    """OmegaConf's message, led by the key it is about (its ``full_key``, which :func:`one_line`
    drops as bookkeeping) unless the message names it: "Interpolation key 'nope' not found" said
    where the value is found, not which key holds the interpolation. A failed interpolation names the
    key that holds it (through a ``${train.lr}`` that reads it) and what to change."""
    message = one_line(exc)
    key = getattr(exc, "full_key", None)
    parent = getattr(exc, "parent_node", None)
    if isinstance(exc, InterpolationResolutionError) and isinstance(key, str) and key and parent is not None:
        return unresolved_line(parent._get_root(), key, message, value=False)  # not a ${train.lr} reading it
    return f"{key}: {message}" if isinstance(key, str) and key and key not in message else message


def describe(exc: BaseException) -> tuple[str, int]:
    """``(message, exit code)`` for an exception that reached the command line's edge."""
    if isinstance(exc, CLIError):
        return exc.message, exc.exit_code
    if isinstance(exc, (NoBatchFitsError, GlobalBatchTooLargeError, StepOutOfMemoryError)):
        return _out_of_memory(exc), RUNTIME_FAILURE
    if isinstance(exc, HydraException) and isinstance(exc.__cause__, OmegaConfBaseException):
        return f"{one_line(exc)}: {one_line(exc.__cause__)}{_list_hint(one_line(exc), one_line(exc.__cause__))}", BAD_INPUT
    if isinstance(exc, OmegaConfBaseException):
        return _keyed(exc), BAD_INPUT
    if isinstance(exc, OverrideParseException):
        return _unparsed(exc), BAD_INPUT
    if isinstance(exc, HydraException) or (isinstance(exc, ValueError) and _raised_in_autobatch(exc)):
        return _install_hint(one_line(exc)), BAD_INPUT
    # an error of the model, data or loss at run time (a ValueError of theirs too: before, it was
    # "bad input", exit status 2, without its type or where it came from), or a bug
    where = "" if type(exc).__module__.startswith("autobatch") else where_raised(exc)  # autobatch's own: phrased to be read
    return f"{type(exc).__name__}: {one_line(exc)}{where}{_notes(exc)}", RUNTIME_FAILURE


def _list_hint(merging: str, why: str) -> str:
    """The override written one list deeper, where a value (or each item) had to be a list:
    ``train.inject_oom=[3,backward]`` got OmegaConf's "int is not a ListConfig, list or tuple",
    which names neither the form (a list of ``[step, phase]`` pairs) nor the fix."""
    found = re.match(r"Error merging override ([\w.+~]+)=(.+)$", merging)
    if found is None or "is not a ListConfig, list or tuple" not in why:
        return ""
    key, value = found.groups()
    form = "a list of lists" if value.startswith("[") else "a list"
    return f"{'' if why.endswith('.') else '.'} {key} takes {form}: {key}=[{value}]"


def traceback_wanted(verbose: object = False) -> bool:
    """Whether to show full tracebacks: ``AUTOBATCH_TRACEBACK`` or Hydra's own ``HYDRA_FULL_ERROR``
    set (not 0), or Hydra's verbose. A Hydra user sets ``HYDRA_FULL_ERROR=1`` out of habit; before,
    it was ignored and the one line still said ``AUTOBATCH_TRACEBACK=1``."""
    flags = (os.environ.get(name, "") for name in ("AUTOBATCH_TRACEBACK", "HYDRA_FULL_ERROR"))
    return any(flag not in ("", "0", "false", "False") for flag in flags) or bool(verbose)


class _FilteredStderr:
    """``sys.stderr`` without Hydra's own lines about a failed job (:data:`_HYDRA_STDERR_NOISE`);
    everything else, attributes included (``isatty``, ``fileno``), goes to the real stream."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if text.strip().startswith(_HYDRA_STDERR_NOISE):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def hydra_noise_filtered(*, verbose: object = False) -> Iterator[None]:
    """While a Hydra app runs, drop Hydra's "Error executing job with overrides" and
    "Set the environment variable HYDRA_FULL_ERROR=1" lines (a failed job of a sweep); kept when
    a traceback is wanted (:func:`traceback_wanted`)."""
    if traceback_wanted(verbose):
        yield
        return
    original = sys.stderr
    sys.stderr = _FilteredStderr(original)
    try:
        yield
    finally:
        if isinstance(sys.stderr, _FilteredStderr):
            sys.stderr = original


@contextmanager
def reported(*, multirun: bool, verbose: object = False) -> Iterator[None]:
    """Turn an exception into the one-line message and exit code.

    A single run prints the message and exits. A job of a sweep raises :class:`CLIError`
    instead, so Hydra marks just that job failed, the sweep goes on, and the summary lists it.
    """
    from .job_signals import signal_name, terminate_as_interrupt

    try:
        with terminate_as_interrupt(multirun):  # a sweep job's SIGTERM: a row too, as a Ctrl-C's
            yield
    except KeyboardInterrupt as exc:  # passes (the command's edge says it); a sweep's summary lists the job
        if multirun:
            from .sweep import record_interrupted

            record_interrupted(f"interrupted ({signal_name(exc)}) before any step trained, nothing saved; run the job again")
        raise
    except Exception as exc:  # noqa: BLE001 - this is the edge
        message, code = describe(exc)
        log_to_files(PREFIX + message)
        if traceback_wanted(verbose):
            if multirun:
                raise
            traceback.print_exc()
            sys.exit(code)
        if multirun:
            raise CLIError(message, code, job=_job_label()) from None
        if not _hand_back(message, code):
            print(PREFIX + message, file=sys.stderr)
        sys.exit(code)


def _job_label() -> str:
    """``job N (its overrides)`` for the running job of a sweep. Hydra prints the first failed
    job's error alone after the sweep, before the summary table: it did not say which job it
    was, and a sweep of several failures (one out of memory, one a bug) read as the whole sweep's."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from .user_config import given_overrides

    num = OmegaConf.select(HydraConfig.get(), "job.num", default=None) if HydraConfig.initialized() else None
    if num is None:  # not a job of a sweep that Hydra numbered
        return ""
    overrides = " ".join(given_overrides())
    return f"job {num}" + (f" ({overrides})" if overrides else "")


def log_to_files(line: str, level: int = logging.ERROR) -> None:
    """Write ``line`` to the log files of this run (Hydra's ``probe.log``/``train.log`` in the run
    directory), not to the console, which gets it printed once. Before, the run's log ended with
    its last trial or step and never said how or why the run ended: a sweep's failed job left a
    ``probe.log`` holding nothing, on a cluster the only file beside its row."""
    record = logging.getLogger("autobatch").makeRecord("autobatch", level, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _hand_back(message: str, code: int) -> bool:
    """Write the error to the parent's file (:data:`ERROR_FILE_ENV`); False where there is none
    or it cannot be written (the error is then printed here)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"message": message, "code": code}, handle)
    except OSError:
        return False
    return True


def handed_back(path: str) -> tuple[str, int] | None:
    """``(message, exit code)`` a child process wrote to ``path`` (:data:`ERROR_FILE_ENV`); None
    where it wrote none (it crashed, or printed its error itself)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return str(data["message"]), int(data["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
