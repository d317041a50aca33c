"""A class of the user's own given whole as a dict: ``'model={_target_: torch.nn.Linear, in_features: 4}'``.

Hydra merges a dict given to a config group's key into the option the group already has. With
no option chosen that is the default one (``model`` is ``gpt``, ``optimizer`` is ``adamw``,
``scheduler`` is ``none``), so the user's class was built with that option's keys: Hydra refused
the dict's own arguments against the option's schema (``model (GPTConfig) has no key
'in_features'``, with advice to add them with ``+`` that led to a second error), or a class that
takes ``**kwargs`` was built silently with ``gpt``'s ``vocab_size``, ``layers``... A user who
types a whole dict with a ``_target_`` means that class with those arguments, which is the
``target`` option of the group. :func:`check_dict_target` names that form in one line before
Hydra composes anything. A dict whose ``_target_`` is the chosen option's own class
(``'model={layers: 4, _target_: autobatch.workloads.models.GPT}'``), one given to an option
chosen on the command line (``model=mlp``) or to an option of the user's own stays Hydra's merge.

The same happens to ``model._target_=mypkg.MyModel`` (``optimizer._target_=``, ``scheduler._target_=``)
without an option chosen: the class is built with the default option's keys; and with one chosen
(``model=mlp model._target_=mypkg.MyModel``, which almost surely meant ``model=target``), with its keys. A class that lacks
one of them is refused by :func:`~autobatch.cli.validation.check_target_arguments`, but one that
takes ``**kwargs`` got ``gpt``'s ``vocab_size``, ``layers``... silently; that is the same line,
naming the ``target`` form. A class that takes each of the option's keys by name
(``optimizer._target_=torch.optim.Adam`` keeps adamw's ``lr``, ``betas``, ``weight_decay``) is
what the override means, and is built so, as is a subclass of the option's own class
(``model=mlp model._target_=mypkg.WideMLP``, ``WideMLP(autobatch.workloads.models.MLP)``).
"""

from __future__ import annotations

import dataclasses
import importlib
import shlex
from pathlib import Path
from typing import Any, Sequence

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser

from .build import locate
from .errors import CLIError
from .schema_keys import schema_of
from .split_words import key_by_key
from .validation import target_parameters

__all__ = ["check_dict_target", "packaged_options"]

#: Config groups with a ``target`` option whose keys are only the class's own arguments.
_GROUPS = ("model", "optimizer", "scheduler")


def packaged_options(group: str) -> set[str]:
    """The names of the packaged options of ``group`` (``gpt``, ``mlp``...), ``target`` left out."""
    from .conf import ensure_conf_module

    folders = [Path(path) / group for path in importlib.import_module(ensure_conf_module()).__path__]
    return {file.stem for folder in folders for file in folder.glob("*.yaml")} - {"target"}


def _dict_targets(job: Sequence[str]) -> list[tuple[str, str, dict]]:
    """``(group, override, dict)`` for each override of ``job`` that gives a group a dict with a ``_target_``."""
    found = []
    for override in OverridesParser.create().parse_overrides(list(job)):
        key, value = override.get_key_element(), override.value()
        if key in _GROUPS and isinstance(value, dict) and "_target_" in value and not override.is_delete():
            found.append((key, override.input_line, value))
    return found


def check_dict_target(config_name: str, job: Sequence[str], command: str) -> None:
    """Raise :class:`CLIError` when ``job`` gives ``model``, ``optimizer`` or ``scheduler`` a dict
    with a ``_target_`` of another class than the group's default packaged option builds (call inside
    :func:`~autobatch.cli.user_config.composing`); the line names the ``target`` option's form."""
    try:
        found = _dict_targets(job)
    except Exception:  # noqa: BLE001 - an override Hydra cannot parse: Hydra's own line says so
        return
    for group, line, value in found:
        chosen = [o for o in job if o.split("=", 1)[0] == group and o != line]
        if chosen:  # model=mlp 'model={...}': the option to merge into is the user's choice
            continue
        rest = [o for o in job if o != line]
        try:
            cfg = compose(config_name, overrides=rest, return_hydra_config=True)
        except Exception:  # noqa: BLE001 - composed again by the caller, where its error is said
            return
        option = cfg.hydra.runtime.choices.get(group)
        node: Any = cfg.get(group)
        if option not in packaged_options(group) or (node is not None and node.get("_target_") == value["_target_"]):
            continue
        keys = [str(k) for k in (node or {}).keys() if k != "_target_"]
        given = key_by_key(line.lstrip("+~")) or (f"{group}=target " + shlex.quote(f"+{line.lstrip('+~')}"))
        raise CLIError(_target_form_line(line, "a dict given to", "is merged into", (group, option), keys,
                                         value["_target_"], "the dict's", f"python -m autobatch {command} {given}"))
    _check_target_override(config_name, job, command)


def _target_form_line(line: str, given: str, kept: str, choice: tuple[str, str], keys: Sequence[str], target: str,
                      whose: str, command_line: str) -> str:
    """The one line for a class of the user's own given to a group's default option: what it got too, and the
    ``target`` form (``command_line``) that builds it with only ``whose`` arguments."""
    group, option = choice
    had = f", whose keys ({', '.join(keys)}) {target} would get too" if keys else ""
    return (f"{line}: {given} {group} {kept} the option {group} already has ({group}={option}){had}; "
            f"a class of your own with only {whose} arguments is the {group}=target option: {command_line}")


def _check_target_override(config_name: str, job: Sequence[str], command: str) -> None:
    """Raise :class:`CLIError` when ``job`` sets ``model._target_`` (``optimizer``, ``scheduler``) on a packaged
    option and the class takes ``**kwargs``, which would take the option's keys silently: the default option,
    or one chosen (``model=mlp model._target_=mypkg.MyModel`` almost surely meant ``model=target``). A class
    that names each of the option's keys, or subclasses the option's own class, is built with them."""
    keyed = {o.lstrip("+").split("=", 1)[0]: o for o in job if not o.startswith("~")}
    cfg = None
    for group in _GROUPS:
        line = keyed.get(f"{group}._target_")
        if line is None:
            continue
        try:
            cfg = cfg or compose(config_name, overrides=list(job), return_hydra_config=True)
            node, option = cfg[group], cfg.hydra.runtime.choices.get(group)
            target = locate(str(node._target_))
            found = target_parameters(target)
        except Exception:  # noqa: BLE001 - composed and validated by the caller, where its error is said
            return
        if option not in packaged_options(group) or found is None or not found[1] or _extends_option(node, target):
            continue  # without **kwargs, check_target_arguments names each key the class does not take
        own = {key.split(".", 1)[1] for key in keyed if key.startswith(f"{group}.")}
        left = [str(k) for k in node.keys() if not str(k).startswith("_") and k not in (*found[0], *own, "inputs")]
        if left:
            raise CLIError(_target_form_line(line, "a _target_ given to", "keeps", (group, option), left,
                                             str(node._target_), "its own", _target_command(config_name, job, group, command)))


def _extends_option(node: Any, target: Any) -> bool:
    """Whether ``target`` subclasses the class the packaged option ``node`` builds (its schema's ``_target_``,
    ``autobatch.workloads.models.MLP`` for ``mlp``): its ``**kwargs`` are then the option's keys, passed on."""
    schema = schema_of(node)
    own = {field.name: field.default for field in dataclasses.fields(schema)}.get("_target_") if schema else None
    try:
        base = locate(own) if isinstance(own, str) else None
    except Exception:  # noqa: BLE001 - a schema's class that does not import: no subclass to judge
        return False
    return isinstance(target, type) and isinstance(base, type) and issubclass(target, base)


def _target_command(config_name: str, job: Sequence[str], group: str, command: str) -> str:
    """``python -m autobatch probe model=target model._target_=X +model.k=v``: ``job``'s keys of ``group``,
    each a key of the ``target`` option as itself and any other added with ``+``."""
    mine = [o for o in job if o.lstrip("+~").startswith(f"{group}.")]
    try:
        fresh = compose(config_name, overrides=[f"{group}=target"])[group]
    except Exception:  # noqa: BLE001 - the form is still right for keys the target option lacks
        fresh = {"_target_": None}
    words = [o if o[0] in "+~" or o.split("=", 1)[0].split(".", 1)[1] in fresh else f"+{o}" for o in mine]
    return f"python -m autobatch {command} {group}=target " + " ".join(shlex.quote(word) for word in words)
