"""The keys a typed config node has: the closest one to a misspelt key, the schema that types a
node, and :func:`check_unknown_keys` for a key added with ``+`` to a typed group (``+probe.stratgy=``),
which would otherwise be carried along and never read. Only a node with a ``_target_`` (a model,
an optimizer, a dataset) takes free keys: they are its constructor's arguments, which
:func:`autobatch.cli.validation.check_target_arguments` checks against its signature instead.
A ``+name=option`` at the top level for a config group there is none of (``+experiment=small``
without the ``--config-dir`` that holds ``experiment/small.yaml``) is named as such, and a loss of
one's own given elsewhere than the ``loss`` group (``+train.loss=``, ``+criterion=``) is told where it goes.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

__all__ = ["close_match", "closest", "schema_of", "check_unknown_keys"]


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word`` (difflib's, cutoff 0.6), or None."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def close_match(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """``" (did you mean <prefix>X?)"`` for the choice X closest to ``word`` (:func:`closest`), or ``""``."""
    found = closest(word, choices)
    return f" (did you mean {prefix}{found}?)" if found else ""


def schema_of(node: Any) -> type | None:
    """The dataclass that types ``node`` (None for an untyped node or a plain value)."""
    if not isinstance(node, DictConfig):
        return None
    schema = OmegaConf.get_type(node)
    return schema if isinstance(schema, type) and dataclasses.is_dataclass(schema) else None


def _takes_free_keys(schema: type) -> bool:
    """A ``_target_`` node's other keys are its constructor's arguments, any the target takes."""
    return any(field.name == "_target_" for field in dataclasses.fields(schema))


def check_unknown_keys(node: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` for a key of a typed node that its schema does not define (only a
    ``+key=`` override can add one), with the closest defined key; recurse into typed children."""
    schema = schema_of(node)
    if schema is None:
        return
    fields = [field.name for field in dataclasses.fields(schema)]
    if not _takes_free_keys(schema):
        for key in node.keys():
            if key not in fields:
                where = prefix.rstrip(".") or "the top level"
                _refuse_own_loss(f"{prefix}{key}")
                value = node[key]
                if not prefix and isinstance(value, str):  # +experiment=small: meant an option of a group of one's own
                    raise ValueError(
                        f"+{key}={value}: there is no config group {key!r} ({key}/{value}.yaml), and the top level has "
                        f"no key {key!r}{close_match(str(key), fields, prefix)}; give the directory that holds "
                        f"{key}/{value}.yaml with --config-dir DIR"
                    )
                if not fields and prefix == "scheduler.":  # scheduler=none, the default: no schedule to set
                    raise ValueError(f"+{prefix}{key}: scheduler is none (no schedule, the default), which has no keys; "
                                     f"choose one first: scheduler=cosine (or linear_warmup, step, target) "
                                     f"{prefix}{key}=VALUE, without the +")
                raise ValueError(
                    f"+{prefix}{key}: {where} has no key {key!r}"
                    f"{close_match(str(key), fields, prefix)}; "
                    "+ adds keys only to a _target_ (model, optimizer, scheduler, data.dataset), whose constructor takes them"
                )
    for key in fields:
        child = None if OmegaConf.is_missing(node, key) else node[key]
        if isinstance(child, DictConfig):
            check_unknown_keys(child, f"{prefix}{key}.")


def _refuse_own_loss(key: str) -> None:
    """``+train.loss=mypkg.my_loss`` (``+criterion=``, ``+train.loss_fn=``): one line saying that the
    loss is the top-level ``loss`` group and how a loss of one's own goes there, not that ``+`` adds
    keys only to a ``_target_`` or that a group ``criterion`` needs ``--config-dir``."""
    from .loss import own_loss_hint

    hint = own_loss_hint(key)
    if hint:
        raise ValueError(f"+{key}: {hint}")
