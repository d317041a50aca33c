"""Which YAML of the user's own sets a key: named in the errors about that key.

A key under a ``_target_`` group that its class does not take (``in_feature`` for
``torch.nn.Linear``) is found by :func:`~autobatch.cli.validation.check_target_arguments` in the
composed config, where it no longer says where it came from. Set in a YAML of the user's own (a
``--config-name`` config, or an option of theirs such as ``myconf/model/tiny.yaml``) the line
named only the key and advised command-line fixes (``~model.in_feature``, ``model=target``) for a
value the file sets again on every run. :func:`set_in` asks Hydra's defaults list which configs
the job merges, in order, and reads each of the user's (``--config-dir``'s) as Hydra loaded it:
the last that sets the key is the file to fix. :func:`naming_file` puts it in the error.
Call both inside :func:`autobatch.cli.user_config.composing` (the job's search path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from omegaconf import OmegaConf

__all__ = ["NotAnArgument", "set_in", "naming_file", "kept_under_missing", "leaves"]

_FILE = "file://"


class NotAnArgument(ValueError):
    """Keys of a ``_target_`` node that its class does not take: ``keys`` (full dotted keys),
    ``detail`` (the error up to its advice) and ``fix`` (the command-line advice)."""

    def __init__(self, detail: str, fix: str, keys: Sequence[str]) -> None:
        super().__init__(f"{detail}. {fix}")
        self.detail, self.fix, self.keys = detail, fix, list(keys)


def _given(key: str, overrides: Sequence[str], repository: Any) -> bool:
    """Whether the command line sets ``key`` (or a node above it); a group's choice
    (``model=tiny``) sets no value itself: its file does."""
    for override in overrides:
        name = override.lstrip("+~").split("=", 1)[0]
        if name.split("@", 1)[0] and repository.group_exists(name.split("@", 1)[0]):
            continue
        if key == name or key.startswith(name + "."):
            return True
    return False


def _sets(config: Any, package: str, key: str) -> bool:
    """Whether ``config``, merged at ``package`` ('' the top level), has a value for ``key``."""
    if package:
        if not key.startswith(package + "."):
            return False
        key = key[len(package) + 1:]
    node: Any = OmegaConf.to_container(config, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def set_in(config_name: str, overrides: Sequence[str], key: str) -> Path | None:
    """The YAML of ``--config-dir`` that sets ``key`` in this job (the last in merge order), or
    None: the command line sets it, a packaged config does, or Hydra cannot tell."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    if _given(key, overrides, loader.repository):  # type: ignore[attr-defined]
        return None
    try:
        found = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - compose reports what is wrong with the overrides
        return None
    where = None
    for entry in found:
        if entry.config_path is None:
            continue
        loaded = loader.repository.load_config(config_path=entry.config_path)  # type: ignore[attr-defined]
        if loaded is None or not str(loaded.path).startswith(_FILE) or loaded.provider in ("main", "hydra"):
            continue  # autobatch's own configs, Hydra's, the schemas
        if _sets(loaded.config, entry.package or "", key):
            where = Path(str(loaded.path)[len(_FILE):]) / f"{entry.config_path}.yaml"
    return where


def naming_file(exc: NotAnArgument, config_name: str, overrides: Sequence[str]) -> ValueError:
    """``exc`` with the YAML that sets each of its keys and the advice to fix it there; ``exc`` as
    it is (a plain ``ValueError``, as a sweep's job prefix expects) where the command line sets them all."""
    files = {key: set_in(config_name, overrides, key) for key in exc.keys}
    named = {key: path for key, path in files.items() if path is not None}
    if not named:
        return ValueError(str(exc))
    if len(set(named.values())) == 1 and len(named) == len(files):
        where = f"set in {next(iter(named.values()))}: correct or remove {'it' if len(named) == 1 else 'them'} there"
        return ValueError(f"{exc.detail}. {where[0].upper()}{where[1:]}")
    shown = "; ".join(f"{key} is set in {path}" for key, path in named.items())
    rest = f"; for the others: {exc.fix}" if len(named) < len(files) else ""
    return ValueError(f"{exc.detail}. {shown}: correct or remove {'it' if len(named) == 1 else 'them'} there{rest}")


def leaves(node: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """``(dotted key, value)`` of each leaf of a plain nested dict (a list, and an empty dict, is a leaf)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


def kept_under_missing(config_name: str, overrides: Sequence[str], cfg: Any) -> str | None:
    """The error (None: nothing to say) for each key that a YAML of the user's own sets to ``???``
    last, in merge order, and the command line does not set, but that ``cfg`` (the job's composed
    config) still holds a value for: the one a config before it set, which OmegaConf's merge keeps
    under a ``???``. The user asked for the key to be given on every run; without this check the
    run went on at the packaged value (``--cfg job`` shows it) without a word. A whole node too
    (``model: ???``, ``optimizer: ???``: the packaged group option stays under it; before, only a
    leaf was named and the run trained the packaged ``gpt``), and a list (``data: {shape: ???}``);
    a group's node is given by its choice on the command line (``model=gpt``)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    repository = loader.repository  # type: ignore[attr-defined]
    try:
        found = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - compose reports what is wrong with the overrides
        return None
    last: dict[str, tuple[Path | None, str]] = {}  # key -> (the user's YAML that sets it ???, who set it before)
    setters: list[tuple[str, str]] = []  # (leaf key, config), in merge order: who set a node's keys before its ???
    for entry in found:
        package = entry.package or ""
        loaded = None if entry.config_path is None or package.startswith("hydra") else \
            repository.load_config(config_path=entry.config_path)
        if loaded is None:
            continue
        own = str(loaded.path).startswith(_FILE) and loaded.provider not in ("main", "hydra")
        tree = OmegaConf.to_container(loaded.config, resolve=False)
        tree = {k: v for k, v in tree.items() if k not in ("defaults", "hydra")}  # type: ignore[union-attr]
        for key, value in leaves(tree, f"{package}." if package else "") if tree else ():
            for above in [k for k in last if key.startswith(k + ".")]:  # a node's ??? that this key fills
                last[above] = (None, entry.config_path)
            if own and value == "???":
                earlier = [c for k, c in setters if k == key or k.startswith(key + ".")]  # a group's: its option's
                before = ([c for c in earlier if c.startswith(key + "/")] or earlier or [entry.config_path])[-1]
                path = Path(str(loaded.path)[len(_FILE):]) / f"{entry.config_path}.yaml"
                last[key] = (path, before)
            else:
                last[key] = (None, entry.config_path)
            setters.append((key, entry.config_path))
    kept = {}
    for key, (path, before) in last.items():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if path is None or _given(key, overrides, repository) or _chosen(key, overrides, repository) \
                or not OmegaConf.is_dict(node):
            continue
        value = OmegaConf.to_container(node, resolve=False).get(leaf, "???")  # type: ignore[union-attr]
        if value != "???":
            kept[key] = (path, f"what {before} sets" if isinstance(value, dict) else f"the {value!r} of {before}")
    return _kept_message(kept, repository) if kept else None


def _chosen(key: str, overrides: Sequence[str], repository: Any) -> bool:
    """Whether ``key`` is a config group whose option the command line chooses (``model=gpt``)."""
    return repository.group_exists(key) and any(o.lstrip("+").split("=", 1)[0].split("@", 1)[0] == key for o in overrides)


def _kept_message(kept: dict[str, tuple[Path, str]], repository: Any) -> str:
    """The one line of :func:`kept_under_missing`: a leaf is set as ``key=VALUE``; a group's node
    (``model: ???``) by choosing an option, named."""
    shown = "; ".join(f"{key}: ??? in {path} ({value} stays under it)" for key, (path, value) in kept.items())
    groups = {key: sorted(repository.get_group_options(key)) for key in kept if repository.group_exists(key)}
    sets = " ".join(f"{key}=OPTION (one of {', '.join(groups[key])})" if key in groups else f"{key}=VALUE" for key in kept)
    file = "give the value in the file" + (f"; a group's option as `- override {next(iter(groups))}: OPTION` in its "
                                           "defaults list, in place of the ???" if groups else "")
    return (f"{shown}: OmegaConf's merge keeps a value already there under a ???, so the run would not ask for "
            f"{'it' if len(kept) == 1 else 'them'}; set {'it' if len(kept) == 1 else 'each'} on the command line: "
            f"{sets} (or {file})")
