"""Check a command line before Hydra runs it, so bad input costs one line, not a traceback.

Hydra reports a misspelt key or a wrong type over several lines, and problems it cannot see
(impossible probe bounds, an unimportable ``_target_``) would only surface inside the job.
:func:`check` composes the config of every job the command line describes (each combination
of a ``-m`` sweep) with Hydra's compose API and runs :func:`~autobatch.cli.build.validate` on
it; the first problem becomes a :class:`CLIError`. It also checks that the run (or sweep)
directory resolves and can be created (Hydra reported both with a traceback). With a flag that
prints the config (``--cfg``, ``--info``...) the overrides are composed but not validated.
Anything it cannot judge (``--help``, sweeper plugins' own syntax) is left to Hydra.

A config of the user's own (``--config-dir``, ``--config-name``) is composed the same way, on
the search path Hydra will use (:mod:`autobatch.cli.user_config`): a missing directory or config
is one line, as is a config that lacks keys because it does not extend the packaged one.
``--shell-completion`` is refused, as are Hydra flags that do not go together or lack their
value. A sweep is ``-m`` or ``hydra.mode=MULTIRUN`` (:func:`_multirun_mode`); :func:`flags_first`
puts Hydra's flags before the overrides. Keys the run will not read (:mod:`autobatch.cli.ignored`)
and a config that does not extend the packaged one are named in ``autobatch: warning:`` lines.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Sequence

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from .build import validate
from .config import SCHEMAS, ProbeAppConfig, TrainAppConfig
from .errors import BAD_INPUT, CLIError, describe, one_line
from .ignored import ignored_keys
from .ranks import launched_rank
from .user_config import (CONFIG_DIR_FLAGS, CONFIG_NAME_FLAGS, CONFIG_PATH_FLAGS, check_config_name, check_extends,
                          composing, config_flags, sweeper_params, without_config_flags)
from .validation import close_match

__all__ = ["check", "flags_first", "job_overrides", "MAX_JOBS_CHECKED"]

#: Sweeps larger than this are checked on their first jobs only.
MAX_JOBS_CHECKED = 64
#: Hydra flags after which a check makes no sense (Hydra prints or does something else).
_HANDS_OFF = {"-h", "--help", "--hydra-help", "--version", "--experimental-rerun"}
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
    (``model=mlp,gpt -m probe.max_batch=64``) were "unrecognized arguments", its whole usage text."""
    valued = {name for name, takes in _PRINTING.items() if takes is True}
    valued |= {*CONFIG_DIR_FLAGS, *CONFIG_NAME_FLAGS, *CONFIG_PATH_FLAGS, "--experimental-rerun"}
    flags: list[str] = []
    overrides: list[str] = []
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        flags.append(arg)
        following = args[index + 1] if index + 1 < len(args) else None
        if "=" not in arg and following is not None and (arg in valued or (_PRINTING.get(arg) == "optional"
                                                                           and following in _INFO_CHOICES)):
            flags.append(following)
            skip = True
    return [*flags, *overrides]


#: Where a dict given to a free node is all of it: the group option that leaves the node empty.
_FRESH = {"data.dataset": "a data option without a dataset (drop data=dataset: data.dataset is then null)",
          "optimizer": "optimizer=target (only _target_ and lr)"}


def _failed_key(exc: BaseException | None) -> str | None:
    """The full key where OmegaConf stopped applying an override (deeper than the override's own
    key when its value is a dict merged into a node), from ``exc`` 's causes; None if none says."""
    while exc is not None:
        full_key = getattr(exc, "full_key", None)
        if isinstance(full_key, str) and full_key:
            return full_key
        exc = exc.__cause__
    return None


def _override_hint(message: str, exc: BaseException | None = None) -> str:
    """Hydra's "Could not override 'probe.stratgy'. To append to your config use +probe.stratgy=..."
    advises ``+``, which a typed group rejects: name the closest key of its schema instead. For
    a dict value (``probe={stratgy: binary}``, ``data.dataset={_target_: ..., root: data}``) the
    key that failed is inside it (``exc`` 's cause names it): before, the message said the
    override's own key did not exist ("data has no key 'dataset' (did you mean data.dataset?)")."""
    found = re.search(r"Could not override '([\w.]+)'\. To append to your config use \+\S+", message)
    if found is None:
        return message
    key = found.group(1)
    failed = _failed_key(exc) or key
    parts = failed.split(".") if failed.startswith(key) else key.split(".")
    schema: typing.Any = ProbeAppConfig
    for depth, part in enumerate(parts):
        fields = [field.name for field in dataclasses.fields(schema)]
        if part not in fields:
            where = ".".join(parts[:depth]) or "the config"
            prefix = where + "." if depth else ""
            return f"Could not override '{key}': {where} has no key {part!r}{close_match(part, fields, prefix)}"
        schema = typing.get_type_hints(schema).get(part)
        if not dataclasses.is_dataclass(schema):  # a free node, unless a group's option types it (model=gpt)
            typed = _option_key_hint(message, key, parts[: depth + 1], exc)
            if typed != message:
                return typed
            if len(parts) == len(key.split(".")):  # untyped (model=target, data.dataset): + adds an argument
                return _free_key_hint(message, key, exc)
            break
    if len(parts) > len(key.split(".")):  # a dict merged into a free node that has no such key
        node = ".".join(parts[:-1])
        fresh = f", or start from {_FRESH[node]}" if node in _FRESH else ""
        return (f"Could not override '{key}': a dict given to {key} is merged into the one already there, and {node} "
                f"has no key {parts[-1]!r}; add it with +{'.'.join(parts)}=VALUE{fresh}")
    return message


def _free_key_hint(message: str, key: str, exc: BaseException | None) -> str:
    """A misspelt argument of a ``_target_`` node (``model.hiden`` where it has ``hidden``): the
    closest key the node has (OmegaConf's error carries it). Hydra only advised ``+model.hiden=``."""
    while exc is not None and not OmegaConf.is_dict(getattr(exc, "parent_node", None)):
        exc = exc.__cause__
    node, (where, part) = getattr(exc, "parent_node", None), key.rsplit(".", 1)
    close = close_match(part, [str(name) for name in node.keys()], f"{where}.") if node is not None else ""
    if not close:
        return message  # no near key: Hydra's advice (+key=VALUE, a new argument) is the one to give
    return f"Could not override '{key}': {where} has no key {part!r}{close}; +{key}=VALUE adds it as a new argument"


def _delete_hint(message: str) -> str:
    """Hydra's words on a ``~key`` it cannot apply, as what to change: a key of a schema cannot
    be removed ("TrainConfig (DictConfig) does not support deletion"), and a null one "does not
    exist" (``~probe.memory_limit``), which read as a misspelt key."""
    typed = re.search(r"override ~([\w.]+): (\w+) \(DictConfig\) does not support deletion", message)
    if typed is not None:
        key = typed.group(1)
        return (f"~{key}: {key} is a key of {typed.group(2)}, which keeps its keys; set {key}=VALUE instead (~ removes "
                "only a key that no schema lists: an argument of model=target, optimizer=target or data.dataset)")
    absent = re.search(r"Could not delete from config\. '([\w.]+)' does not exist", message)
    if absent is None:
        return message
    key, schema, parts = absent.group(1), ProbeAppConfig, absent.group(1).split(".")
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(schema):  # a free node (model=target): the key may be absent
            return f"~{key}: {'.'.join(parts[:depth])} has no key {part!r} (or it is null), so there is nothing to remove"
        fields = [field.name for field in dataclasses.fields(schema)]
        if part not in fields:
            where = ".".join(parts[:depth])
            return f"~{key}: {where or 'the config'} has no key {part!r}{close_match(part, fields, where + '.' if where else '')}"
        schema = typing.get_type_hints(schema).get(part)
    return f"~{key}: {key} is null already, so there is nothing to remove; set {key}=VALUE to change it"


def _option_key_hint(message: str, key: str, node: list[str], exc: BaseException | None) -> str:
    """For a node that its group's option types (``model=gpt``: ``GPTConfig``; ``optimizer=adamw``),
    the closest key of that schema: Hydra advised ``+model.layrs=2``, which the model's
    constructor then rejects. A node no schema types (``model=target``) keeps the advice:
    there ``+`` adds a constructor argument."""
    cause, schema = exc, None
    while cause is not None and schema is None:
        found = getattr(cause, "object_type", None)
        schema = found if isinstance(found, type) and dataclasses.is_dataclass(found) else None
        cause = cause.__cause__
    full = (_failed_key(exc) or key).split(".")
    if schema is None or full[: len(node)] != node or len(full) != len(node) + 1:
        return message
    where, name = ".".join(node), full[-1]
    keys = [field.name for field in dataclasses.fields(schema) if not field.name.startswith("_")]
    return (f"Could not override '{key}': {where} ({schema.__name__}) has no key {name!r}"
            f"{_keys_hint(name, keys, where + '.')} (+{'.'.join(full)}=VALUE passes an argument its _target_ takes that "
            "the schema does not list)")


def _keys_hint(name: str, keys: list[str], prefix: str) -> str:
    """The closest of ``keys`` to ``name``, else all of them."""
    return close_match(name, keys, prefix) or f"; its keys: {', '.join(keys)}"


def _composition_hint(message: str, exc: BaseException) -> str:
    """A wrong key or value in a YAML (``--config-name`` 's, or a group option's of ``--config-dir``):
    Hydra's "In 'mytrain': ConfigKeyError raised while composing config: Key 'stpes' not in
    'TrainConfig'" names the schema's class, not the key; name the file, the key and the closest one."""
    text = str(exc)
    where = re.search(r"In '([^']+)': (\w+) raised while composing config:\s*(.*)", text)
    key = re.search(r"full_key: ([\w.]+)", text)
    if where is None or key is None:
        return message
    head = f"{where.group(1)}.yaml sets {key.group(1)}"
    kind = re.search(r"object_type=(\w+)", text)
    schemas = [*SCHEMAS.values(), ProbeAppConfig, TrainAppConfig]
    schema = next((node for node in schemas if kind and node.__name__ == kind.group(1)), None)
    if where.group(2) != "ConfigKeyError" or schema is None:
        return f"{head}: {where.group(3).strip()}"
    *node, name = key.group(1).split(".")
    keys = [field.name for field in dataclasses.fields(schema) if not field.name.startswith("_")]
    prefix, hint = ".".join(node) + "." if node else "", _keys_hint(name, keys, ".".join(node) + ".")
    if node in (["model"], ["optimizer"]) and "did you mean" not in hint:  # its schema is the default option's
        hint += f"; for a {node[0]} class of your own, put `- override {node[0]}: target` in the defaults list"
    return f"{head}, but {prefix.rstrip('.') or 'the config'} has no key {name!r}{hint}"


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
            if "hydra" not in (raw := str(OmegaConf.to_container(OmegaConf.select(cfg, node))[leaf])):
                raise CLIError(f"{key}={raw}: {one_line(exc)}; define what it names, or give another {key}") from None
        except Exception:  # noqa: BLE001 - composed again below, where its error is the user's
            pass
        else:
            with open_dict(cfg):
                del cfg["hydra"]  # as compose() leaves it without return_hydra_config
            return cfg, value
    return compose(config_name, overrides=job), None


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


def check(command: str, args: Sequence[str]) -> None:
    """Raise :class:`CLIError` (exit 2) naming the first problem in ``args``; else return
    (after printing a warning line for each key the run will not read)."""
    config_dir, config_name = config_flags(args)  # also before --help: Hydra reports these over several lines
    args = without_config_flags(args)
    if any(arg.split("=", 1)[0] in _HANDS_OFF for arg in args):
        return
    _check_flag_mix(command, args)
    args, printing = _without_printing_flags(args)
    multirun = any(arg in _MULTIRUN for arg in args)
    overrides = [arg for arg in args if arg not in _MULTIRUN | _RUN]
    _refuse_flags(command, overrides)
    name = config_name or command
    try:
        warnings: list[str] = []
        with composing(command, config_dir):
            check_config_name(name, config_dir)
            multirun = multirun or _multirun_mode(name, overrides, config_name is not None)
            jobs = job_overrides([*sweeper_params(name, overrides), *overrides] if multirun else overrides, multirun)
            packaged = compose(command)  # what the user did not change
            for index, job in enumerate(jobs):
                # the first job's run directory (a multirun's sweep directory) is checked too
                key = None if index or printing else "hydra.sweep.dir" if multirun else "hydra.run.dir"
                cfg, directory = _composed(name, job, key)
                if index == 0 and config_name is not None:
                    warnings += filter(None, [check_extends(command, name, job, cfg)])
                if not printing:
                    validate(cfg)
                    warnings += ignored_keys(command, cfg, packaged)
                if directory:
                    _check_output_dir(key, str(directory))
    except CLIError:
        raise
    except Exception as exc:  # noqa: BLE001 - turned into one line
        message, _ = describe(exc)
        raise CLIError(_composition_hint(_delete_hint(_override_hint(message, exc)), exc), BAD_INPUT) from exc
    _warn(warnings, set())
