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
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser

from .errors import CLIError
from .split_words import key_by_key

__all__ = ["check_dict_target"]

#: Config groups with a ``target`` option whose keys are only the class's own arguments.
_GROUPS = ("model", "optimizer", "scheduler")


def _packaged_options(group: str) -> set[str]:
    """The names of the packaged options of ``group`` (``gpt``, ``mlp``...), ``target`` left out."""
    from .conf import CONF_MODULE, ensure_conf_module

    ensure_conf_module()
    folders = [Path(path) / group for path in sys.modules[CONF_MODULE].__path__]
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
        if option not in _packaged_options(group) or (node is not None and node.get("_target_") == value["_target_"]):
            continue
        keys = [str(k) for k in (node or {}).keys() if k != "_target_"]
        given = key_by_key(line.lstrip("+~")) or (f"{group}=target " + shlex.quote(f"+{line.lstrip('+~')}"))
        had = f", whose keys ({', '.join(keys)}) {value['_target_']} would get too" if keys else ""
        raise CLIError(
            f"{line}: a dict given to {group} is merged into the option {group} already has ({group}={option}){had}; "
            f"a class of your own with only the dict's arguments is the {group}=target option: "
            f"python -m autobatch {command} {given}"
        )
