"""A config of the user's own (``--config-dir DIR --config-name NAME``), judged before Hydra runs.

Hydra's way to change a packaged app's config is a config that extends it through its
defaults list, setting only what differs::

    # myconf/mytrain.yaml; python -m autobatch train --config-dir myconf --config-name mytrain
    defaults:
      - train      # autobatch's own train config (probe for probe): its groups, optimizer.lr: ${train.lr},
      - _self_     #   the run and sweep directories, the job name and the sweep summary
    train:
      lr: 0.5

``--config-dir`` adds DIR to the search path after autobatch's configs (``pkg://autobatch.conf``),
so ``train``, ``probe`` and every group option (``model: mlp``) resolve as before, DIR's own
options (``myconf/model/tiny.yaml``) join the groups, and a YAML of DIR named ``train`` or
``probe`` is never found (the packaged one is): give yours another name.

A config that does not extend the packaged one loses what only that one wires up: the
optimizer's ``lr`` is no longer ``train.lr``, runs go to Hydra's ``outputs/<date>/<time>``, and
sweeps have no summary. :func:`check_extends` says so in one warning; when the config lacks keys
the commands need (``model``, ``train``...) it is refused in one line naming the fix. Hydra's
own handling of these flags prints a missing directory or config over several lines with exit
status 1; :func:`config_flags` checks them first. ``--config-path`` *replaces* the packaged
configs instead of adding to them (nothing a user config extends is left), so it is refused
with a pointer to ``--config-dir``.
"""

from __future__ import annotations

import os
import shlex
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra import initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from .conf import CONF_MODULE
from .errors import CLIError
from .key_source import leaves
from .override_text import as_given

__all__ = [
    "CONFIG_DIR_FLAGS", "CONFIG_NAME_FLAGS", "CONFIG_PATH_FLAGS", "REQUIRED_KEYS", "config_flags",
    "without_config_flags", "composing", "check_config_name", "check_extends", "rerun_flags", "command_line",
    "run_roots", "sweeper_params", "check_self_last", "given_overrides", "shadowed", "job_name_override",
    "help_overrides",
]  # fmt: skip

CONFIG_DIR_FLAGS = ("-cd", "--config-dir")
CONFIG_NAME_FLAGS = ("-cn", "--config-name")
CONFIG_PATH_FLAGS = ("-cp", "--config-path")
#: The top-level keys every command reads; a config without one of them cannot run.
REQUIRED_KEYS = ("model", "data", "optimizer", "probe", "train", "plan", "device")
#: The packaged configs a user config of each command may extend.
_BASES = {"probe": ("probe", "train"), "train": ("train",)}
_HOW = "put `defaults: [{base}, _self_]` at its top and set only what differs (docs/cli.md, \"Your own config\")"


def _flag_value(args: Sequence[str], names: Sequence[str]) -> tuple[str | None, list[int]]:
    """The value of the last of the flags ``names`` in ``args`` (``-cd DIR`` or ``--config-dir=DIR``)
    and the indices it and its value take; a flag with no value is one :class:`CLIError`."""
    value, taken = None, []
    for index, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name not in names:
            continue
        if "=" in arg:
            value, spots = inline, [index]
        elif index + 1 < len(args) and not args[index + 1].startswith("-"):
            value, spots = args[index + 1], [index, index + 1]
        else:
            raise CLIError(f"{name} needs a value: {name} DIR for a directory, {name} NAME for a config")
        taken += spots
    return value, taken


def config_flags(args: Sequence[str]) -> tuple[str | None, str | None]:
    """``(config dir, config name)`` that ``args`` give (None: not given), checked: the directory
    must exist and be a directory; ``--config-path`` is refused (it drops the packaged configs)."""
    if any(arg.split("=", 1)[0] in CONFIG_PATH_FLAGS for arg in args):
        raise CLIError(
            "--config-path replaces autobatch's packaged configs (the probe and train bases a config of your own "
            "extends); give your config's directory with --config-dir DIR instead"
        )
    config_dir, _ = _flag_value(args, CONFIG_DIR_FLAGS)
    config_name, _ = _flag_value(args, CONFIG_NAME_FLAGS)
    if config_dir is not None:
        path = Path(config_dir).expanduser().absolute()
        if not path.is_dir():
            what = "is a file, not a directory" if path.exists() else "does not exist"
            raise CLIError(f"--config-dir {config_dir}: {path} {what}; give the directory that holds your YAML configs")
    if config_name is not None and not config_name.strip():
        raise CLIError("--config-name needs a config's name (a YAML in --config-dir, without .yaml)")
    return config_dir, config_name


def job_name_override(command: str, args: Sequence[str]) -> list[str]:
    """``["hydra.job.name=<command>"]`` when ``args`` give a ``--config-name`` (and no
    ``hydra.job.name`` of their own): the job is named by the command it runs, not by the config.
    A config of one's own that extends ``train`` serves ``probe`` too, and named its probes
    ``train``: their log was ``train.log``, and a probe sweep's summary had ``train`` 's columns
    (``steps``, ``recoveries``, ``final_loss``, always empty) among its own. :func:`command_line`
    leaves it out of the command it records (the dispatcher adds it again)."""
    if not any(arg.split("=", 1)[0] in CONFIG_NAME_FLAGS for arg in args):
        return []
    if any(_override_key(arg) == "hydra.job.name" for arg in args):
        return []
    return [f"hydra.job.name={command}"]


def help_overrides(command: str, args: Sequence[str]) -> list[str]:
    """``hydra.help.app_name`` and ``hydra.help.header`` of the packaged ``command`` config, as
    overrides, for ``--help`` with a ``--config-name`` of the user's own: a config extending
    ``train`` serves ``probe`` too, and ``probe --help`` printed ``autobatch train`` 's header.
    A help key the user's YAML sets itself is left to it."""
    import importlib.resources as resources

    if not {"-h", "--help"} & set(args) or not any(arg.split("=", 1)[0] in CONFIG_NAME_FLAGS for arg in args):
        return []
    config_dir, config_name = _flag_value(args, CONFIG_DIR_FLAGS)[0], _flag_value(args, CONFIG_NAME_FLAGS)[0]
    own_path = Path(config_dir or ".").expanduser() / f"{(config_name or '').removesuffix('.yaml')}.yaml"
    own = OmegaConf.load(own_path) if config_dir and own_path.is_file() else OmegaConf.create()
    packaged = OmegaConf.create((resources.files(CONF_MODULE) / f"{command}.yaml").read_text()).hydra.help
    return [f"hydra.help.{key}='" + str(packaged[key]).replace("'", "\\'") + "'" for key in ("app_name", "header")
            if OmegaConf.select(own, f"hydra.help.{key}", default=None) is None]


def without_config_flags(args: Sequence[str]) -> list[str]:
    """``args`` without ``--config-dir`` and ``--config-name`` and their values."""
    taken = set(_flag_value(args, CONFIG_DIR_FLAGS)[1]) | set(_flag_value(args, CONFIG_NAME_FLAGS)[1])
    return [arg for index, arg in enumerate(args) if index not in taken]


@contextmanager
def composing(job_name: str, config_dir: str | None = None) -> Iterator[None]:
    """Hydra's compose API over the search path the command will have: autobatch's configs,
    then ``config_dir`` (where ``--config-dir`` puts it, before the structured schemas)."""
    with initialize_config_module(CONF_MODULE, version_base="1.3", job_name=job_name):
        if config_dir is not None:
            from hydra._internal.hydra import Hydra
            from hydra._internal.utils import create_automatic_config_search_path
            from hydra.core.config_search_path import SearchPathQuery
            from hydra.core.global_hydra import GlobalHydra

            search_path = create_automatic_config_search_path(None, f"{CONF_MODULE}.{job_name}", None)
            where = f"file://{Path(config_dir).expanduser().absolute()}"
            search_path.prepend(provider="command-line", path=where, anchor=SearchPathQuery(provider="schema"))
            GlobalHydra.instance().clear()
            Hydra.create_main_hydra2(job_name, search_path)  # initialize_config_module's exit restores the old one
        yield


def _packaged_yamls(node: Any, prefix: str = "") -> Iterator[str]:
    """The relative paths of the packaged YAML configs under ``node`` (``model/mlp.yaml``)."""
    for child in node.iterdir():
        if child.is_dir():
            yield from _packaged_yamls(child, f"{prefix}{child.name}/")
        elif child.name.endswith(".yaml"):
            yield prefix + child.name


def _same_file(path: Path, other: str) -> bool:
    """Whether ``path`` is the file ``other`` (``--config-dir`` naming the packaged ``conf/`` itself)."""
    try:
        return path.samefile(other)
    except OSError:
        return False


def shadowed(config_dir: str | None) -> str | None:
    """A warning (None: nothing to say) naming the YAMLs of ``config_dir`` that have the path of a
    packaged config (``myconf/model/mlp.yaml``, ``myconf/probe.yaml``): ``--config-dir`` puts DIR
    after autobatch's configs, so Hydra reads the packaged one and never the user's, and a copy of
    ``model/mlp.yaml`` edited to ``width: 7`` ran the packaged width 256 without a word."""
    import importlib.resources as resources

    if config_dir is None:
        return None
    packaged = resources.files(CONF_MODULE)
    directory = Path(config_dir).expanduser()
    found = [name for name in sorted(_packaged_yamls(packaged))
             if (directory / name).is_file() and not _same_file(directory / name, str(packaged / name))]
    if not found:
        return None
    fixes = []
    for name in found:
        group, _, option = name.removesuffix(".yaml").rpartition("/")
        fixes.append(f"{directory / group / ('my_' + option)}.yaml, chosen with {group}=my_{option}" if group
                     else f"{directory / ('my_' + option)}.yaml, given as --config-name my_{option}")
    return (f"{', '.join(str(directory / name) for name in found)}: never read, since autobatch's own "
            f"{', '.join(name.removesuffix('.yaml') for name in found)} come{'s' if len(found) == 1 else ''} first "
            f"on the search path (--config-dir adds its directory after them); rename yours: {'; '.join(fixes)}")


def check_config_name(config_name: str, config_dir: str | None) -> None:
    """``CLIError`` unless the config ``config_name`` is on the search path (call inside
    :func:`composing`): Hydra's own message lists its search path over several lines."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    name = config_name.removesuffix(".yaml")
    if loader.repository.config_exists(name):  # type: ignore[attr-defined]
        return
    where = f"{config_dir} or " if config_dir else ""
    raise CLIError(
        f"--config-name {config_name}: no {name}.yaml in {where}autobatch's configs (probe, train); "
        f"give the name of a YAML{' in ' + config_dir if config_dir else ' with --config-dir DIR'}, without .yaml"
    )


def _extended(command: str, config_name: str, overrides: Sequence[str]) -> bool:
    """Whether the config ``config_name`` is, or extends, the packaged config of ``command``."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    try:
        found = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - compose reports what is wrong with the overrides
        return True
    return any(entry.config_path in _BASES[command] for entry in found)


def check_extends(command: str, config_name: str, overrides: Sequence[str], cfg: DictConfig) -> str | None:
    """A warning (None: nothing to say) for a config that does not extend the packaged
    ``command`` config; ``CLIError`` when it also lacks a key the commands need."""
    if config_name.removesuffix(".yaml") in _BASES[command] or _extended(command, config_name, overrides):
        return None
    base = _BASES[command][0]
    missing = [key for key in REQUIRED_KEYS if key not in cfg or OmegaConf.is_missing(cfg, key)]
    if missing:
        raise CLIError(
            f"--config-name {config_name} has no {', '.join(missing)} (it does not extend autobatch's {base} config); "
            + _HOW.format(base=base)
        )
    if command == "train" and _extended("probe", config_name, overrides):  # probe's: run dirs, summary, all but lr
        return (f"--config-name {config_name} extends autobatch's probe config, not its train config, so optimizer.lr "
                "is not train.lr and runs go to outputs/probe/; " + _HOW.format(base=base))
    lost = "optimizer.lr is not train.lr, " if command == "train" else ""
    return (
        f"--config-name {config_name} does not extend autobatch's {base} config, so {lost}runs go to Hydra's "
        f"outputs/<date>/<time> and sweeps get no summary; " + _HOW.format(base=base)
    )


def check_self_last(config_name: str, overrides: Sequence[str], cfg: DictConfig) -> str | None:
    """A warning (None: nothing to say) for a config of the user's own whose values its defaults
    list overrides (call inside :func:`composing`): with ``_self_`` before ``train`` or a group
    choice, Hydra composes the config's own keys first and the packaged ones over them, so
    ``train: {steps: 3}`` ran the packaged 20 steps without a word. Names the first key lost."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    name = config_name.removesuffix(".yaml")
    try:
        found = loader.compute_defaults_list(name, list(overrides), RunMode.RUN).defaults  # type: ignore[attr-defined]
        own = loader.repository.load_config(config_path=name)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - compose reports what is wrong with the config
        return None
    if own is None or (found and found[-1].primary and found[-1].is_self):
        return None  # _self_ last (Hydra's default when the list does not name it): its values win
    raw = OmegaConf.to_container(own.config, resolve=False)
    composed = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    given = {_override_key(o) for o in overrides}
    for key, value in leaves({k: v for k, v in raw.items() if k not in ("defaults", "hydra")}):  # type: ignore[union-attr]
        if any(key == g or key.startswith(g + ".") for g in given):
            continue  # the command line set it
        there: object = composed
        for part in key.split("."):
            there = there.get(part) if isinstance(there, dict) else None
        if there != value and str(there) != str(value):
            return (f"--config-name {config_name} sets {key}: {value}, but the config runs {key}={there}: its defaults "
                    "list puts _self_ before other entries, whose values then override its own; put `- _self_` last")
    return None


def sweeper_params(config_name: str, overrides: Sequence[str]) -> list[str]:
    """The sweep a config sets in ``hydra.sweeper.params`` (``model.width: 16,32``), as
    ``key=value`` overrides (call inside :func:`composing`), less the keys the command line sets:
    Hydra's basic sweeper puts them before the command line's. Without them a sweep that a YAML
    of the user's own asks for was checked as its command line alone, and a misspelt key there
    reached Hydra, which printed it over five lines (exit status 1) advising ``+model.widht=``."""
    from hydra import compose

    hydra_overrides = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        params = OmegaConf.select(compose(config_name, overrides=hydra_overrides, return_hydra_config=True),
                                  "hydra.sweeper.params", default=None)
    except Exception:  # noqa: BLE001 - the composition of each job reports what is wrong
        return []
    given = {_override_key(o).lstrip("+~") for o in overrides}
    return [f"{key}={value}" for key, value in (params or {}).items() if str(key) not in given]


def rerun_flags(command: str) -> list[str]:
    """The config-location flags that run this Hydra job again: ``--config-dir`` for a directory
    given on the command line, ``--config-name`` for a config other than the command's own."""
    hydra_cfg = HydraConfig.get()
    flags = []
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            flags += ["--config-dir", str(source.path)]  # absolute: Hydra made it so
    name = hydra_cfg.job.config_name
    if name and name != command:
        flags += ["--config-name", name]
    return flags


#: Hydra overrides that say how Hydra ran the job, not what it ran: Hydra adds ``hydra.mode`` to
#: every job (``MULTIRUN`` in a sweep, where a job's own command, one value a key, is one run).
#: (The overrides :func:`autobatch.cli.ranks.hydra_overrides` adds are on ranks other than 0,
#: which never write a command.)
_NOT_REPEATED = ("hydra.mode",)


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def given_overrides(part: str = "task", hydra: Any = None) -> list[str]:
    """This job's overrides as given (``hydra.overrides.task``, or ``"hydra"`` for the ``hydra.*``
    ones), unresolved; of ``hydra`` (a job's ``hydra`` node, as a sweep's callback reads it) where
    given, else of the running job. Read element by element, OmegaConf takes the ``${...}`` in an override for
    an interpolation against Hydra's own node: ``'model.width=${.layers}'`` (relative to
    ``model``) or a key given twice, once as ``${oc.env:UNSET}``, crashed the command with a
    traceback before it ran, and the command recorded to rerun the job, and the one ``train``'s
    probe child runs, had the values resolved there instead of the interpolations given."""
    given = getattr((HydraConfig.get() if hydra is None else hydra).overrides, part, None) or []
    if isinstance(given, ListConfig):
        given = OmegaConf.to_container(given, resolve=False)
    return as_given([str(override) for override in given])  # type: ignore[union-attr]  # a sweep job's unescaped


def command_line(command: str, *, extra: Sequence[str] = (), drop: Sequence[str] = ()) -> str:
    """``python -m autobatch <command>`` with this job's config flags and overrides (but keys
    in ``drop``, and those ``extra`` sets again), then ``extra``: what reproduces (or, with
    ``extra``, continues) the job, shell-quoted so that it can be pasted into a shell. Its
    overrides are the job's own (one value each in a sweep) and the ``hydra.*`` ones given
    (``hydra.job.chdir=true``, ``hydra.run.dir=...``), which Hydra keeps apart from the job's."""
    left_out = {*drop, *_NOT_REPEATED, *map(_override_key, extra)}
    given = [*given_overrides("task"), *given_overrides("hydra")]
    added = f"hydra.job.name={command}"  # the dispatcher's (job_name_override): not the user's to repeat
    overrides = [o for o in given if _override_key(o) not in left_out and o != added]
    words = [*rerun_flags(command), *overrides, *extra]
    return " ".join(["python -m autobatch", command, *map(shlex.quote, words)])


def run_roots(base: Path) -> list[Path]:
    """Where this config's runs go, for ``train.resume=latest`` to search: the fixed part of
    ``hydra.run.dir`` and ``hydra.sweep.dir`` before their first interpolation (``outputs/train``
    of ``outputs/train/${now:...}``; ``outputs`` for a config that sets neither), under ``base``
    when relative. A directory with no interpolation is one run's, found as the run's own."""
    hydra_cfg = HydraConfig.get()
    roots = []
    for node in (hydra_cfg.run, hydra_cfg.sweep):
        raw = str(OmegaConf.to_container(node, resolve=False).get("dir", ""))  # type: ignore[union-attr]
        if "${" not in raw:
            continue
        fixed = raw.split("${", 1)[0]
        root = Path(fixed) if fixed.endswith(("/", os.sep)) else Path(fixed).parent
        root = root if root.is_absolute() else base / root
        if root.resolve() not in (base.resolve(), Path(root.anchor)):  # never the whole working directory
            roots.append(root)
    return list(dict.fromkeys(roots))
