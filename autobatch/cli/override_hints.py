"""What to change, in place of Hydra's and OmegaConf's words on an override or a YAML they
cannot apply (:func:`autobatch.cli.preflight.check` turns the first problem into one line).

Hydra advises ``+key=VALUE`` for any key it cannot override, which a typed group then rejects;
these hints name the closest key of the schema, the key inside a dict that failed, what ``~key``
can remove, and, for a YAML of the user's own, the file and the key it sets.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import typing

from omegaconf import OmegaConf

from .config import SCHEMAS, ProbeAppConfig, TrainAppConfig
from .loss import own_loss_hint
from .schema_keys import close_match, closest

__all__ = ["override_hint", "delete_hint", "composition_hint", "own_target_hint", "integer_key_hint"]

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


def override_hint(message: str, exc: BaseException | None = None, overrides: typing.Sequence[str] = ()) -> str:
    """Hydra's "Could not override 'probe.stratgy'. To append to your config use +probe.stratgy=..."
    advises ``+``, which a typed group rejects: name the closest key of its schema instead. For
    a dict value (``probe={stratgy: binary}``, ``data.dataset={_target_: ..., root: data}``) the
    key that failed is inside it (``exc`` 's cause names it): before, the message said the
    override's own key did not exist ("data has no key 'dataset' (did you mean data.dataset?)")."""
    found = re.search(r"Could not override '([\w.]+)'\. To append to your config use \+\S+", message)
    if found is None:
        return _option_hint(message)
    key = found.group(1)
    failed = _failed_key(exc) or key
    parts = failed.split(".") if failed.startswith(key) else key.split(".")
    schema: typing.Any = ProbeAppConfig
    for depth, part in enumerate(parts):
        fields = [field.name for field in dataclasses.fields(schema)]
        if part not in fields:
            where = ".".join(parts[:depth]) or "the config"
            prefix = where + "." if depth else ""
            loss = own_loss_hint(key)  # train.loss=mypkg.my_loss: the loss is the top-level loss group
            return f"Could not override '{key}': {where} has no key {part!r}" + (
                f"; {loss}" if loss else close_match(part, fields, prefix))
        schema = typing.get_type_hints(schema).get(part)
        if not dataclasses.is_dataclass(schema):  # a free node, unless a group's option types it (model=gpt)
            typed = _option_key_hint(message, key, parts[: depth + 1], exc, overrides)
            if typed != message:
                return typed
            if len(parts) == len(key.split(".")):  # untyped (model=target, data.dataset): + adds an argument
                return _free_key_hint(message, key, exc, overrides)
            break
    if len(parts) > len(key.split(".")):  # a dict merged into a free node that has no such key
        node = ".".join(parts[:-1])
        fresh = f", or start from {_FRESH[node]}" if node in _FRESH else ""
        return (f"Could not override '{key}': a dict given to {key} is merged into the one already there, and {node} "
                f"has no key {parts[-1]!r}; add it with +{'.'.join(parts)}=VALUE{fresh}")
    return message


#: How a class of one's own given as a group's option (``model=mynet.Net``) is written: Hydra said only
#: "Could not find 'model/mynet.Net'" and listed the options, ``target`` among them unexplained.
_OWN_CLASS = {
    "model": lambda path: f"model=target model._target_={path} (+model.<argument>=VALUE for each argument)",
    "optimizer": lambda path: f"optimizer=target optimizer._target_={path} (+optimizer.<argument>=VALUE for each argument)",
    "scheduler": lambda path: f"scheduler=target scheduler._target_={path} (+scheduler.<argument>=VALUE for each argument)",
    "data": lambda path: f"+data.dataset._target_={path} (+data.dataset.<argument>=VALUE for each argument)",
}


#: Words for an option that spelling does not bring near it: ``device=gpu`` was told ``did you mean
#: device=cpu?`` (closest by letters), the opposite of what was meant.
_SYNONYMS = {"gpu": "cuda"}


def _named(value: str, options: typing.Sequence[str]) -> str | None:
    """The option ``value`` names up to case or a synonym (``GPU``: ``cuda``), else None."""
    near = {name.lower(): name for name in options}
    return near.get(value.lower()) or near.get(_SYNONYMS.get(value.lower(), ""))


def _option_hint(message: str) -> str:
    """Hydra's "Could not find 'scheduler/Cosine' Available options in 'scheduler': cosine ..." with
    the closest option named (``did you mean scheduler=cosine?``), as for a misspelt key."""
    found = re.search(r"Could not find '([\w/]+)/([^'/]+)'\s*Available options in '[\w/]+':\s*(.+)$", message)
    if found is None:
        return _choice_hint(message)
    group, option, options = found.group(1), found.group(2), found.group(3).split()
    close = _named(option, options) or next(iter(difflib.get_close_matches(option, options, n=1, cutoff=0.6)), None)
    if close is None and group == "loss" and "." in option:  # loss=mypkg.my_loss: an import path, not an option
        return (f"{message} (loss={option} names no option; a loss of your own by import path: loss._target_={option} "
                "(+loss._partial_=true for a function of (output, target)))")
    if close is None and group in _OWN_CLASS and "." in option:  # model=mynet.Net: the same, for a class
        return f"{message} ({group}={option} names no option; a class by import path: {_OWN_CLASS[group](option)})"
    return f"{message} (did you mean {group}={close}?)" if close else message


#: OmegaConf's words for a value outside a closed set (an ``Enum`` field of :mod:`.choices`).
_NOT_A_CHOICE = re.compile(r"override ([\w.]+)=\S*: Invalid value '([^']*)', expected one of \[([^\]]*)\]")


def _choice_hint(message: str) -> str:
    """OmegaConf's "Error merging override probe.strategy=halvng: Invalid value 'halvng', expected
    one of [auto, ..., halving, ...]" with the closest choice named (``did you mean probe.strategy=halving?``)."""
    found = _NOT_A_CHOICE.search(message)
    if found is None:
        return message
    key, value, choices = found.group(1), found.group(2), [c.strip() for c in found.group(3).split(",")]
    same = _named(value, choices)
    return message + (f" (did you mean {key}={same}?)" if same else close_match(value, choices, f"{key}="))


def _given_value(message: str, key: str, overrides: typing.Sequence[str]) -> str:
    """The value the command line gave ``key`` (a sweep's ``16,64`` whole), else the one Hydra's "+key=VALUE"
    advice names: Hydra composes a sweep job by job, so its advice held the first job's value alone."""
    given = [o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0] == key]
    if given:
        return given[-1]
    found = re.search(rf"use \+{re.escape(key)}=(\S+)", message)
    return found.group(1).rstrip(":") if found else "VALUE"


def _free_key_hint(message: str, key: str, exc: BaseException | None, overrides: typing.Sequence[str] = ()) -> str:
    """A misspelt argument of a ``_target_`` node (``model.hiden`` where it has ``hidden``): the
    closest key the node has (OmegaConf's error carries it), else the closest argument of its
    ``_target_`` that the node leaves out (``model.bais`` for ``torch.nn.Linear`` 's ``bias``), or,
    for the name of one, why ``+`` adds it. Hydra only advised ``+model.hiden=``, which the
    constructor then rejects."""
    while exc is not None and not OmegaConf.is_dict(getattr(exc, "parent_node", None)):
        exc = exc.__cause__
    node, (where, part) = getattr(exc, "parent_node", None), key.rsplit(".", 1)
    if node is None:
        return message
    keys = [str(name) for name in node.keys()]
    if not keys:  # a null node (data.dataset by default): Hydra's "+key" advice came with "not in struct"
        value = _given_value(message, key, overrides)
        fix = (f"add it with +{key}={value} (and +{where}.<argument>=VALUE for each argument of it)"
               if part == "_target_" else f"add its class first: +{where}._target_=CLASS +{key}={value}")
        return f"Could not override '{key}': {where} is null (nothing is set there yet); {fix}"
    close = close_match(part, keys, f"{where}.")
    if close:
        return f"Could not override '{key}': {where} has no key {part!r}{close}; +{key}=VALUE adds it as a new argument"
    target = node.get("_target_") if "_target_" in node else None  # an argument the config leaves unset
    arguments = [name for name in target_parameters(target) if name not in keys] if isinstance(target, str) else []
    if part in arguments:  # Hydra's "+key=VALUE" advice, said as why
        return (f"Could not override '{key}': {where} does not set {part!r} yet (an argument of {target}); add it "
                f"with +{key}={_given_value(message, key, overrides)}")
    near = close_match(part, arguments, f"+{where}.")
    if near:
        return (f"Could not override '{key}': {where} has no key {part!r}{near[:-2]}, an argument of {target} "
                f"that the config does not set?)")
    return message  # no near key: Hydra's advice (+key=VALUE, a new argument) is the one to give


def target_parameters(path: str) -> list[str]:
    """The named arguments of the class or function at import ``path`` (a ``_target_``), for a hint
    on a misspelt key; ``[]`` when it cannot be imported or its signature read (the check of the
    target itself reports that, in its own line, once the overrides apply)."""
    from .build import locate  # build imports the hints' modules; here only when a key failed

    try:
        signature = inspect.signature(locate(path))
    except (ImportError, TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "params")]


def delete_hint(message: str) -> str:
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


def _option_key_hint(message: str, key: str, node: list[str], exc: BaseException | None,
                     overrides: typing.Sequence[str] = ()) -> str:
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
    value = _given_value(message, key, overrides)
    other = None if closest(name, keys) else _other_option(where, name, schema)
    if not keys and where in _EMPTY_OPTION:  # scheduler=none (the default) has no keys to set
        option, found = other or (_EMPTY_OPTION[where][1], name)
        return (f"Could not override '{key}': {where} is {_EMPTY_OPTION[where][0]}, which has no keys; choose one "
                f"first: {where}={option} {where}.{found}={value} ({where}= {_EMPTY_OPTION[where][2]})")
    if other is not None:  # sgd's momentum under adamw: `+` would pass it to a class that refuses it
        option, found = other
        said = f"{found} is" if found == name else f"did you mean {found}? It is"
        return (f"Could not override '{key}': {where} ({schema.__name__}) has no key {name!r}; {said} a key of "
                f"{where}={option}, not of the {where} chosen: choose that one with {where}={option} "
                f"{where}.{found}={value} ({schema.__name__}'s keys: {', '.join(keys)})")
    return (f"Could not override '{key}': {where} ({schema.__name__}) has no key {name!r}"
            f"{_keys_hint(name, keys, where + '.')} (+{'.'.join(full)}=VALUE passes an argument its _target_ takes that "
            "the schema does not list)")


def _other_option(group: str, name: str, chosen: type) -> tuple[str, str] | None:
    """``(option, key)``: the packaged option of ``group`` other than ``chosen`` whose schema has
    ``name`` or the key closest to it (``optimizer.momentun`` under adamw: ``("sgd", "momentum")``),
    else None. Hydra's advice, ``+optimizer.momentun=VALUE``, went on to AdamW, which refused it."""
    prefix = f"schema_{group}_"
    options = {schema_name[len(prefix):]: [field.name for field in dataclasses.fields(schema) if not field.name.startswith("_")]
               for schema_name, schema in SCHEMAS.items() if schema_name.startswith(prefix) and schema is not chosen}
    exact = [option for option, keys in options.items() if name in keys]  # an exact key before a near one
    if exact:
        return exact[0], name
    return next(((option, found) for option, keys in options.items() if (found := closest(name, keys))), None)


#: A group whose option has no keys (the default ``scheduler=none``): (what it is, the option to
#: choose instead, all the options). Before, a key set on it read "its keys: " and named no fix.
_EMPTY_OPTION = {"scheduler": ("none (no schedule, the default)", "cosine", "cosine | linear_warmup | step | target")}


def _keys_hint(name: str, keys: list[str], prefix: str) -> str:
    """The closest of ``keys`` to ``name``, else all of them."""
    return close_match(name, keys, prefix) or f"; its keys: {', '.join(keys)}"


def composition_hint(message: str, exc: BaseException) -> str:
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
    prefix = ".".join(node) + "." if node else ""  # a top-level key: no leading dot (it said "did you mean .train?")
    hint = _keys_hint(name, keys, prefix)
    if node in (["model"], ["optimizer"]) and "did you mean" not in hint:  # its schema is the default option's
        hint += f"; for a {node[0]} class of your own, put `- override {node[0]}: target` in the defaults list"
    if not node and where.group(1).split("/")[0] == name:  # an option of a group of the user's own: package `name`
        hint = (f"; an option of a group of your own ({name}/) is placed under the key {name}, which the config does "
                 "not have: put `# @package _global_` as its first line and set the config's keys in it "
                 "(e.g. `train: {steps: 5}`)")
    loss = own_loss_hint(key.group(1))  # `loss: {_target_: mypkg.my_loss}` in the user's YAML
    return f"{head}, but {prefix.rstrip('.') or 'the config'} has no key {name!r}{f'; {loss}' if loss else hint}"



def own_target_hint(message: str, overrides: list[str]) -> str:
    """``model._target_=mymods.Net +model.width=16`` without ``model=target`` keeps the default
    option (``gpt``), whose schema already has ``width`` (Hydra: "Either remove + prefix ... or
    ``++``") or lacks the class's own keys ("not in struct"): neither says that the model option to
    start from is ``target``. Add that when the failed key is under a ``_target_`` the command line
    sets (``model``, ``optimizer``) and no group option is chosen for it."""
    for group in ("model", "optimizer"):
        given = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
        if f"{group}._target_" not in given or group in given or not re.search(rf"'{group}\.\w+'", message):
            continue
        fresh = f"{group}._target_ of your own starts from {_FRESH_TARGET[group]}: add {group}=target"
        taken = re.search(rf"An item is already at '({group}\.\w+)'", message)
        if taken:  # Hydra's "remove + prefix, or ++" leads to the schema's keys being passed to the class
            return f"+{taken.group(1)} cannot be added: the {group} option's schema already has it; {fresh}"
        return f"{message.rstrip('.')}; {fresh}"
    return message


_FRESH_TARGET = {"model": "model=target (only _target_ and inputs; +model.<argument>=VALUE for each argument)",
                 "optimizer": "optimizer=target (only _target_ and lr; +optimizer.<argument>=VALUE for the others)"}


#: OmegaConf's words for a float merged into an int key, under Hydra's "Error merging override".
_FLOAT_FOR_INT = re.compile(r"Error merging override ([\w.]+)=(\S+): Value '([^']*)' of type 'float' could not be "
                            r"converted to Integer")


def integer_key_hint(message: str, overrides: typing.Sequence[str]) -> str:
    """A float given to an integer key: say that the key takes integers and what to give. A sweep
    ``train.steps=range(1,2.5,0.5)`` makes floats (Hydra's ``range`` does for a float step or
    bound), and the job's "Error merging override train.steps=1.0: Value '1.0' of type 'float'
    could not be converted to Integer" named neither the ``range`` nor the fix (``range(1,3)``)."""
    found = _FLOAT_FOR_INT.search(message)
    if found is None:
        return message
    key, value = found.group(1), found.group(3)
    swept = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == key and "range(" in o]
    if swept:
        fix = _integer_range(swept[0])
        return (f"{message}: {key} takes integers, and a range() with a float step or float bounds ({key}={swept[0]}) "
                f"makes floats; sweep integers{f', e.g. {key}={fix}' if fix else ''}")
    whole = value.replace(".", "", 1).isdigit() and float(value).is_integer()
    return f"{message}: {key} takes integers" + (f", e.g. {key}={int(float(value))}" if whole else f", not {value}")


def _integer_range(text: str) -> str:
    """``range(1,2.5,0.5)`` as the integer ``range(1,3)`` that covers it ("" where it cannot be read)."""
    found = re.fullmatch(r"\s*range\(([^()]*)\)\s*", text)
    try:
        numbers = [float(part.split("=", 1)[-1]) for part in found.group(1).split(",")] if found else []
    except ValueError:
        return ""
    if not 1 <= len(numbers) <= 3 or not all(map(math.isfinite, numbers)):
        return ""
    start, stop, step = ([0.0] + numbers + [1.0])[-3:] if len(numbers) == 1 else (numbers + [1.0])[:3]
    if step < 0:  # counting down: the integers from start's ceiling down past stop's floor
        start, stop, step = math.ceil(start), math.floor(stop), min(-1, round(step))
    else:
        start, stop, step = math.floor(start), math.ceil(stop), max(1, round(step))
    return f"range({start},{stop}{f',{step}' if step != 1 else ''})"
