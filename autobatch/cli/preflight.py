"""Check a command line before Hydra runs it, so bad input costs one line, not a traceback.

Hydra reports a misspelt key or a wrong type over several lines, and problems it cannot see
(impossible probe bounds, an unimportable ``_target_``) would only surface inside the job.
:func:`check` composes the config of every job the command line describes (each combination
of a ``-m`` sweep) with Hydra's compose API and runs :func:`~autobatch.cli.build.validate` on
it; the first problem becomes a :class:`CLIError`. It also checks that the run (or sweep)
directory resolves and can be created (Hydra reported both with a traceback). With a flag that
prints the config (``--cfg``, ``--info``...) or the help (``--help``, ``--hydra-help``: Hydra
composes them outside its error reporting, a traceback) the overrides are composed but not
validated. Anything it cannot judge (sweeper plugins' own syntax) is left to Hydra. The hint
that names what to change in place of Hydra's words is :mod:`autobatch.cli.override_hints`'s.

A config of the user's own (``--config-dir``, ``--config-name``) is composed the same way, on
the search path Hydra will use (:mod:`autobatch.cli.user_config`): a missing directory or config
is one line, as is a config that lacks keys because it does not extend the packaged one.
``--shell-completion`` is refused, as are Hydra flags that do not go together or lack their
value. A sweep is ``-m`` or ``hydra.mode=MULTIRUN`` (:func:`_multirun_mode`); :func:`flags_first`
puts Hydra's flags before the overrides. Keys the run will not read (:mod:`autobatch.cli.ignored`)
a config that does not extend the packaged one (or puts ``_self_`` before what overrides its values)
and a ``hydra/launcher`` given to one run are named in ``autobatch: warning:`` lines.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError, InterpolationToMissingValueError

from .build import validate
from .dict_target import check_dict_target
from .errors import BAD_INPUT, CLIError, describe, one_line
from .ignored import ignored_keys, unread_overrides
from .interpolations import mistyped_interpolation, unresolved_line
from .key_source import NotAnArgument, kept_under_missing, naming_file
from .override_hints import composition_hint as _composition_hint
from .override_hints import delete_hint as _delete_hint
from .override_hints import override_hint as _override_hint
from .override_hints import integer_key_hint, own_target_hint
from .ranks import launched_rank
from .split_words import check_split
from .user_config import (CONFIG_DIR_FLAGS, CONFIG_NAME_FLAGS, CONFIG_PATH_FLAGS, check_config_name, check_extends,
                          check_self_last, composing, config_flags, shadowed, sweeper_params, without_config_flags)

__all__ = ["check", "flags_first", "hydra_help_args", "job_overrides", "MAX_JOBS_CHECKED"]

#: Sweeps larger than this are checked on their first jobs only.
MAX_JOBS_CHECKED = 64
#: Hydra flags after which a check makes no sense (Hydra prints or does something else).
_HANDS_OFF = {"--version", "--experimental-rerun"}
#: Hydra's help flags: Hydra composes the overrides for them (as one run) outside its error
#: reporting, so they are composed here first; the config is not validated (help prints it).
_HELP = {"-h", "--help", "--hydra-help"}
#: Hydra's flags that the dispatcher cannot honour: ``python -m autobatch`` is no script that
#: Hydra's shell completion could call back.
_REFUSED = {"-sc", "--shell-completion"}
#: Set in ``train``'s child probe (:mod:`autobatch.cli.isolated`): its parent already warned.
QUIET_ENV = "AUTOBATCH_NO_WARNINGS"
#: Hydra flags that print the config instead of running, and whether a value follows them
#: (``"optional"``: only one of ``_INFO_CHOICES``).
_PRINTING = {"-c": True, "--cfg": True, "-p": True, "--package": True, "--resolve": False, "-i": "optional", "--info": "optional"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
_MULTIRUN = {"-m", "--multirun"}
#: Hydra's ``--run`` (``-r``): one run, what Hydra does without ``-m`` (a ``hydra.mode`` the
#: config or an override sets still wins, as in Hydra); it takes no value.
_RUN = {"-r", "--run"}


def job_overrides(overrides: Sequence[str], multirun: bool) -> list[list[str]]:
    """The override list of each job: one job, or the product of a sweep's choices (a ``glob()``
    of a group's options lists them through the loader of the Hydra :func:`composing` set up)."""
    if not multirun:
        return [list(overrides)]
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(list(overrides))
    choices: list[list[str]] = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise CLIError(f"{override.input_line}: only discrete sweeps (a,b,c or range()) can be checked")
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            value = override.get_value_element_as_str()
            choices.append([f"{key}={value if value is not None else ''}"])
    return [list(job) for job in itertools.islice(itertools.product(*choices), MAX_JOBS_CHECKED)]


def _without_printing_flags(args: Sequence[str]) -> tuple[list[str], bool]:
    """``args`` without the flags that print the config (and their values); whether there were any."""
    rest: list[str] = []
    printing, skip = False, False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name not in _PRINTING:
            rest.append(arg)
            continue
        printing = True
        takes = _PRINTING[name]
        following = args[index + 1] if index + 1 < len(args) else None
        if "=" not in arg and following is not None and (takes is True or (takes and following in _INFO_CHOICES)):
            skip = True
    return rest, printing


def flags_first(args: Sequence[str]) -> list[str]:
    """``args`` with Hydra's flags (and their values) before the overrides. Hydra's parser takes
    the overrides as one run of positionals, so those after a flag between them
    (``model=mlp,gpt -m probe.max_batch=64``) were "unrecognized arguments", its whole usage text.
    A flag whose value is optional given without one (``--info``) goes last: put before the
    overrides, Hydra's parser took the first one as its value (``model=mlp --info``: "invalid
    choice: 'model=mlp'")."""
    valued = {name for name, takes in _PRINTING.items() if takes is True}
    valued |= {*CONFIG_DIR_FLAGS, *CONFIG_NAME_FLAGS, *CONFIG_PATH_FLAGS, "--experimental-rerun"}
    flags: list[str] = []
    overrides: list[str] = []
    bare: list[str] = []  # optional-value flags given without their value
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        following = args[index + 1] if index + 1 < len(args) else None
        optional = "=" not in arg and _PRINTING.get(arg) == "optional"
        if optional and following not in _INFO_CHOICES:
            bare.append(arg)
            continue
        flags.append(arg)
        if "=" not in arg and following is not None and (arg in valued or optional):
            flags.append(following)
            skip = True
    return [*flags, *overrides, *bare]


def hydra_help_args(command: str, args: list[str]) -> list[str]:
    """``args`` for ``--hydra-help``: Hydra composes its help from the overrides alone (no app
    config), so an override of the app's (``model=mlp``) failed there with a traceback; they are
    dropped, and the help lists the flags the dispatcher honours (``conf/hydra/hydra_help/autobatch.yaml``),
    not Hydra's shell completion and ``--config-path``, which it refuses."""
    if "--hydra-help" not in args:
        return args
    kept = [arg for arg in args if "=" not in arg or arg.startswith("-") or arg.lstrip("+~").startswith("hydra")]
    return [*kept, "hydra/hydra_help=autobatch", f"hydra.help.app_name=autobatch {command}"]


def _check_output_dir(key: str, value: str) -> None:
    """``CLIError`` unless the run or sweep directory ``value`` is a directory or can be created."""
    path = Path(value).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CLIError(f"{key}={value}: {existing} is a file, not a directory; choose another {key}")
    if existing == path:
        return
    try:  # the only reliable test (permissions, read-only and virtual file systems): make a directory there
        os.rmdir(tempfile.mkdtemp(prefix=".autobatch-", dir=existing))
    except OSError as exc:
        raise CLIError(f"{key}={value}: cannot create it in {existing} ({exc.strerror}); choose another {key}") from None


def _composed(config_name: str, job: list[str], key: str | None) -> tuple[Any, Any]:
    """``(cfg, run directory)``: the job's config and, given ``key``, the run (or sweep) directory, from
    one composition; None where only Hydra's run can resolve it (an interpolation of ``hydra`` keys).
    Any other that fails (``${oc.env:SCRATCH}`` unset) is one line: Hydra's run crashed on it."""
    if key is not None:
        try:
            cfg = compose(config_name, overrides=job, return_hydra_config=True)
            value = OmegaConf.select(cfg, key)
        except InterpolationResolutionError as exc:
            node, leaf = key.rsplit(".", 1)
            if "hydra" not in str(OmegaConf.to_container(OmegaConf.select(cfg, node))[leaf]):
                raise CLIError(unresolved_line(cfg, key, one_line(exc))) from None
        except Exception:  # noqa: BLE001 - composed again below, where its error is the user's
            pass
        else:
            with open_dict(cfg):
                del cfg["hydra"]  # as compose() leaves it without return_hydra_config
            return cfg, value
    return compose(config_name, overrides=job), None


def _printed_part(args: Sequence[str]) -> str:
    """The value of ``--cfg`` (``-c``) in ``args``: ``job``, ``hydra`` or ``all``."""
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("-c", "--cfg"):
            return value if "=" in arg else args[index + 1]
    return "all"


def _check_resolves(cfg: Any) -> None:
    """``CLIError`` naming the first key of ``cfg`` (the job's config, then Hydra's node) whose
    interpolation cannot be resolved (``${oc.env:UNSET}``): ``--cfg job --resolve`` printed it as
    Hydra's traceback, exit status 1. One that reads Hydra's runtime (``${hydra:runtime.cwd}``,
    ``${hydra.job.num}``) resolves only in Hydra's run, where it is left to be printed."""
    leaves = sorted(_leaves(OmegaConf.to_container(cfg, resolve=False)), key=lambda leaf: leaf[0].startswith("hydra."))
    for key, value in leaves:
        if not (isinstance(value, str) and "${" in value):
            continue
        try:
            OmegaConf.select(cfg, key)
        except InterpolationToMissingValueError:
            continue  # a value Hydra's run fills in
        except InterpolationResolutionError as exc:
            if "HydraConfig was not set" in str(exc):
                continue
            if key.startswith("hydra.overrides."):  # an override (Hydra prints them resolved), not a key
                key, value = value.lstrip("+~").split("=", 1)[0], value.split("=", 1)[-1]
                raise CLIError(f"{key}={value}: {one_line(exc)}; define what it names, or give another {key}") from None
            raise CLIError(unresolved_line(cfg, key, one_line(exc))) from None
    _check_types(cfg)


def _check_types(cfg: Any) -> None:
    """``CLIError`` for a key whose interpolation resolves to a value its type refuses (text for a list)."""
    mistyped = mistyped_interpolation(cfg)
    if mistyped:
        raise CLIError(mistyped)


def _leaves(node: object, prefix: str = "") -> Any:
    """``(dotted key, value)`` of each leaf of a plain nested dict or list (a list's items by index)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if not items:
        yield prefix.rstrip("."), node
        return
    for key, value in items:
        yield from _leaves(value, f"{prefix}{key}.")


def _warn(lines: Sequence[str], said: set[str]) -> None:
    """Print each warning once (a sweep composes many jobs), on rank 0 only under a launcher."""
    for line in lines:
        if line not in said and launched_rank() == 0 and not os.environ.get(QUIET_ENV):
            print(f"autobatch: warning: {line}", file=sys.stderr)
        said.add(line)


def _refuse_flags(command: str, args: Sequence[str]) -> None:
    """``CLIError`` for a Hydra flag the dispatcher cannot honour, and for unknown options."""
    refused = [arg for arg in args if arg.split("=", 1)[0] in _REFUSED]
    if refused:
        raise CLIError(f"{refused[0]}: shell completion is not available for python -m autobatch (Hydra's completion "
                       f"calls back a script of its own); see python -m autobatch {command} --help for the keys")
    unknown = [arg for arg in args if arg.startswith("-") and arg not in _MULTIRUN | _RUN]
    if unknown:
        raise CLIError(f"unknown option {unknown[0]!r}; see python -m autobatch {command} --help")


def _multirun_mode(config_name: str, overrides: Sequence[str], own_config: bool) -> bool:
    """Whether ``hydra.mode=MULTIRUN`` asks for a sweep without ``-m`` (an override, or a config of
    the user's own that sets it), read as Hydra reads it (call inside :func:`composing`). Without
    this a sweep so asked for had its comma lists composed as one run and was refused. Only the
    ``hydra`` overrides are composed: a misspelt task key is then reported as itself."""
    hydra_overrides = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if not own_config and not any(o.lstrip("+~").startswith("hydra.mode") for o in hydra_overrides):
        return False  # the packaged configs set no mode
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    mode = GlobalHydra.instance().hydra.get_mode(config_name=config_name, overrides=hydra_overrides)  # type: ignore[union-attr]
    return mode == RunMode.MULTIRUN


def _check_flag_mix(command: str, args: Sequence[str]) -> None:
    """``CLIError`` for Hydra flags that do not go together: Hydra raised its ``ValueError``
    about them outside its own error reporting, a traceback with exit status 1."""
    given = {arg.split("=", 1)[0] for arg in args if arg.startswith("-")}
    pairs = (("-r", "--run"), ("-m", "--multirun"), ("-c", "--cfg"), ("-i", "--info"))
    modes = [next(name for name in names if name in given) for names in pairs if given & set(names)]
    if len(modes) > 1:
        raise CLIError(f"{modes[0]} and {modes[1]} do not go together (Hydra takes one of --run, --multirun, --cfg and "
                       f"--info); drop one (--cfg and --info show the config of one run: python -m autobatch {command} --cfg job)")
    if "--resolve" in given and not given & {"-c", "--cfg"}:
        raise CLIError(f"--resolve only goes with --cfg: python -m autobatch {command} --cfg job --resolve")
    for index, arg in enumerate(args):  # Hydra's parser prints its usage text for a missing value
        name, inline, value = *arg.partition("=")[::2], None
        if name in ("-c", "--cfg", "-p", "--package"):
            value = inline if "=" in arg else (args[index + 1] if index + 1 < len(args) else "")
        if name in ("-c", "--cfg") and value not in ("job", "hydra", "all"):
            raise CLIError(f"{name} takes job, hydra or all (got {value!r}): python -m autobatch {command} --cfg job")
        if name in ("-p", "--package") and (not value or value.startswith("-") or "=" in value):
            raise CLIError(f"{name} needs a package (a config node) after it: python -m autobatch {command} --cfg job "
                           f"--package probe")


def _one_run(command: str, overrides: Sequence[str]) -> None:
    """``--help`` shows the config of one run (Hydra's help composes one): a sweep's choices
    (``--help -m model=mlp,gpt``) are one line naming the key, where Hydra advised ``--multirun``."""
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_sweep_override():
            key = override.get_key_element()
            raise CLIError(f"--help shows the config of one run: give {key} one value "
                           f"(python -m autobatch {command} --help {key}=VALUE)")


def _validate_job(cfg: Any, job: list[str], jobs: list[list[str]], index: int, name: str) -> None:
    """``validate(cfg)``; in a sweep of several jobs a bad value names the job and the overrides
    that make it differ (``job 3 (scheduler=linear_warmup): scheduler.warmup_steps=100 ...``):
    the line named only the key, which most jobs of the sweep set well. A key a YAML of the
    user's own sets names that file (:mod:`autobatch.cli.key_source`)."""
    try:
        try:
            validate(cfg)
        except NotAnArgument as exc:
            raise naming_file(exc, name, job) from exc
    except ValueError as exc:
        if len(jobs) < 2 or type(exc) is not ValueError:
            raise
        varying = [override for override in job if not all(override in other for other in jobs)]
        raise ValueError(f"job {index} ({' '.join(varying)}): {exc}") from exc


def check(command: str, args: Sequence[str]) -> None:
    """Raise :class:`CLIError` (exit 2) naming the first problem in ``args``; else return
    (after printing a warning line for each key the run will not read)."""
    config_dir, config_name = config_flags(args)  # also before --help: Hydra reports these over several lines
    args = without_config_flags(args)
    if any(arg.split("=", 1)[0] in _HANDS_OFF for arg in args):
        return
    check_split(args)  # before Hydra reads the first word of a split override alone
    helping = any(arg in _HELP for arg in args)  # before: a misspelt override after --help was a traceback
    args = [arg for arg in args if arg not in _HELP | (_MULTIRUN if helping else set())]
    _check_flag_mix(command, args)
    resolving = _printed_part(args) if "--resolve" in args else None
    args, printing = _without_printing_flags(args)
    printing = printing or helping
    multirun = any(arg in _MULTIRUN for arg in args)
    overrides = [arg for arg in args if arg not in _MULTIRUN | _RUN]
    _refuse_flags(command, overrides)
    name = config_name or command
    try:
        warnings: list[str] = list(filter(None, [shadowed(config_dir)]))
        with composing(command, config_dir):
            check_config_name(name, config_dir)
            if helping:
                _one_run(command, overrides)
            multirun = not helping and (multirun or _multirun_mode(name, overrides, config_name is not None))
            jobs = job_overrides([*sweeper_params(name, overrides), *overrides] if multirun else overrides, multirun)
            packaged = compose(command)  # what the user did not change
            for index, job in enumerate(jobs):
                # the first job's run directory (a multirun's sweep directory) is checked too
                key = None if index or printing else "hydra.sweep.dir" if multirun else "hydra.run.dir"
                check_dict_target(name, job, command)
                cfg, directory = _composed(name, job, key)
                if index == 0 and config_name is not None:
                    warnings += filter(None, [check_extends(command, name, job, cfg), check_self_last(name, job, cfg)])
                kept = kept_under_missing(name, job, cfg) if config_name is not None else None
                if kept and not printing:  # a ??? of the user's own over a packaged value (--cfg job: a warning)
                    raise CLIError(kept)
                warnings += [kept] if kept and index == 0 else []
                if resolving:  # what --cfg prints: the job's config, Hydra's node or both
                    _check_resolves(cfg if resolving == "job" else compose(name, overrides=job, return_hydra_config=True))
                if not printing:
                    _check_types(cfg)
                    _validate_job(cfg, job, jobs, index, name)
                    warnings += ignored_keys(command, cfg, packaged)
                if directory:
                    _check_output_dir(key, str(directory))
    except CLIError:
        raise
    except Exception as exc:  # noqa: BLE001 - turned into one line
        message, _ = describe(exc)
        message = _composition_hint(_delete_hint(_override_hint(integer_key_hint(message, overrides), exc, overrides)), exc)
        raise CLIError(own_target_hint(message, overrides), BAD_INPUT) from exc
    if not printing:  # the command line's, not each job's: a sweep of train.steps is one line
        warnings += unread_overrides(command, overrides)
    launcher = [o for o in overrides if o.lstrip("+~").startswith(("hydra/launcher=", "hydra.launcher."))]
    if launcher and not multirun and not printing:  # Hydra reads no launcher for one run: said, not silently dropped
        warnings.append(f"{launcher[0]} is ignored: a launcher runs the jobs of a sweep, and this command runs one "
                        f"(add -m to sweep: python -m autobatch {command} -m {launcher[0]} KEY=A,B)")
    _warn(warnings, set())
