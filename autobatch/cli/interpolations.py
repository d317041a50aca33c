"""Which key to change when an interpolation cannot resolve, and how.

OmegaConf names the key it was reading when an interpolation failed, which is often a plain
reference to another key: the packaged ``optimizer.lr`` is ``${train.lr}``, so a config of the
user's own with ``train: {lr: ${oc.env:MYLR}}`` and ``MYLR`` unset failed as "optimizer.lr:
... Environment variable 'MYLR' not found", naming a key the user never set. The line here
follows such references to the key that holds the failing interpolation, and for an unset
environment variable says to set it (or to give the key a value).
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf

__all__ = ["source_key", "unresolved_line"]

#: A value that is only a reference to another key by its absolute path (``${train.lr}``).
_REFERENCE = re.compile(r"^\$\{([A-Za-z_][\w]*(?:\.[\w]+)*)\}$")
_ENV = re.compile(r"Environment variable '([^']+)' not found")
_ABSENT = object()


def _raw(container: Any, key: str) -> Any:
    """The value at the dotted ``key`` of a plain nested dict/list, unresolved; ``_ABSENT`` if none."""
    node = container
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _ABSENT
    return node


def source_key(cfg: Any, key: str) -> tuple[str, Any]:
    """``(key, raw value)`` of the key whose own interpolation fails when ``key`` is read: each
    plain reference (``${train.lr}``) is followed to the key it names, a resolver
    (``${oc.env:MYLR}``) or a string with text around the reference stops there."""
    container = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg
    raw, seen = _raw(container, key), {key}
    while isinstance(raw, str) and (found := _REFERENCE.match(raw)) is not None:
        target = found.group(1)
        following = _raw(container, target)
        if following is _ABSENT or target in seen:  # the reference itself is what fails (a missing key, a cycle)
            break
        key, raw = target, following
        seen.add(key)
    return key, raw


def unresolved_line(cfg: Any, key: str, message: str, *, value: bool = True) -> str:
    """One line for an interpolation read at ``key`` that failed with ``message``: the key that holds
    it (with its value, given ``value``), the reason, and what to change (``export MYLR=...`` or
    ``train.lr=VALUE`` for an unset environment variable; else to define what it names or give the
    key another value)."""
    key, raw = source_key(cfg, key)
    shown = "" if raw is _ABSENT or not value else f"={raw}"
    env = _ENV.search(message)
    if env is not None:
        name = env.group(1)
        fix = (f"set the environment variable {name} (export {name}=...) or give {key}=VALUE, or a default in the "
               f"config: ${{oc.env:{name},DEFAULT}}")
    else:
        fix = f"define what it names, or give another {key}"
    return f"{key}{shown}: {message}; {fix}"
