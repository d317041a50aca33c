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

__all__ = ["raw_value", "source_key", "unresolved_line", "text_for_list", "wrong_type_line", "mistyped_interpolation"]

#: A value that is only a reference to another key by its absolute path (``${train.lr}``).
_REFERENCE = re.compile(r"^\$\{([A-Za-z_][\w]*(?:\.[\w]+)*)\}$")
_ENV = re.compile(r"Environment variable '([^']+)' not found")
_ABSENT = object()


def raw_value(container: Any, key: str, default: Any = _ABSENT) -> Any:
    """The value at the dotted ``key`` of a plain nested dict/list, unresolved; ``default`` if none."""
    node = container
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def source_key(cfg: Any, key: str) -> tuple[str, Any]:
    """``(key, raw value)`` of the key whose own interpolation fails when ``key`` is read: each
    plain reference (``${train.lr}``) is followed to the key it names, a resolver
    (``${oc.env:MYLR}``) or a string with text around the reference stops there."""
    container = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg
    raw, seen = raw_value(container, key), {key}
    while isinstance(raw, str) and (found := _REFERENCE.match(raw)) is not None:
        target = found.group(1)
        following = raw_value(container, target)
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


def text_for_list(cfg: Any, key: str, resolved: Any) -> str | None:
    """One line when ``key`` takes a list but its interpolation gave text: ``${oc.env:SHAPE}``
    with ``SHAPE='[4]'`` is the string ``'[4]'`` (an environment variable is always read as text),
    which was "data.shape must be positive integers, got [4]", or with ``--cfg job --resolve``
    OmegaConf's traceback; ``oc.decode`` parses it. None when that is not the case."""
    key, raw = source_key(cfg, key)
    if not (isinstance(raw, str) and raw.startswith("${") and isinstance(resolved, str)):
        return None
    return (f"{key}={raw} is the text {resolved!r}, not a list: an interpolation gives a string (an environment "
            f"variable is always text); parse it with oc.decode, quoted for the shell: "
            f"'{key}=\"${{oc.decode:{raw}}}\"'")


def wrong_type_line(cfg: Any, key: str, message: str) -> str:
    """One line for ``key`` whose interpolation resolved to a value its type refuses
    (OmegaConf's ``ValidationError``): :func:`text_for_list` 's where that is text for a list,
    else the key, its value as given and OmegaConf's reason."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))  # untyped: resolves without checking
    try:
        resolved = OmegaConf.select(plain, key)
    except Exception:  # noqa: BLE001 - reported below with OmegaConf's own reason
        resolved = None
    found, raw = source_key(cfg, key)
    return text_for_list(cfg, key, resolved) or f"{found}={raw}: {message}; give {found} a value of its type"


def _interpolated(node: Any, prefix: str = "") -> Any:
    """Dotted keys of a plain nested dict whose value is an interpolation (lists are not entered)."""
    for name, value in node.items() if isinstance(node, dict) else ():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            yield from _interpolated(value, key + ".")
        elif isinstance(value, str) and "${" in value:
            yield key


def mistyped_interpolation(cfg: Any) -> str | None:
    """:func:`wrong_type_line` for the first key of ``cfg`` (not ``hydra.*``) whose interpolation
    resolves to a value its type refuses, else None. OmegaConf checks the type only when the
    config is resolved as a whole (``--cfg job --resolve``, instantiating the optimizer), so
    ``optimizer.betas=${oc.env:BETAS}`` was a traceback there and "Invalid value assigned: str
    is not a ListConfig, list or tuple." (no key) as a run's error. Unresolvable ones are left
    to the callers' own messages."""
    from omegaconf.errors import OmegaConfBaseException, ValidationError

    keys = [key for key in _interpolated(OmegaConf.to_container(cfg, resolve=False)) if not key.startswith("hydra.")]
    if not keys:
        return None
    trial = OmegaConf.create(cfg) if not OmegaConf.is_config(cfg) else cfg.copy()
    for key in keys:
        try:
            OmegaConf.update(trial, key, OmegaConf.select(trial, key), merge=False)
        except ValidationError as exc:
            return wrong_type_line(cfg, key, str(exc).splitlines()[0])
        except OmegaConfBaseException:  # cannot resolve (an unset variable, ${hydra:...}): said elsewhere
            continue
    return None
