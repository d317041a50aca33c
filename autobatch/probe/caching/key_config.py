"""How the probe cache's key reads an OmegaConf config (a Hydra ``DictConfig`` or ``ListConfig``): by
key, each value's interpolation resolved, as the code that holds it reads it. Apart from
:mod:`~autobatch.probe.caching.key_code` and :mod:`~autobatch.probe.caching.key_reads`, which both use it,
because omegaconf is not imported here (``import autobatch`` does not need it) and a config is told by
its class's module. Before review 38 a config was keyed by its class alone (its values sit in private
attributes): a ``TrainStep`` whose loss read ``cfg.loss.chunks`` from a ``DictConfig`` was served the
one-chunk config's answer under four chunks, and a ``cache_key=cfg.model`` of any width keyed alike.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["MISSING", "config_child", "config_data", "is_config"]

#: what :func:`config_child` answers for a value that is not there (or cannot be read here)
MISSING = object()
#: how many levels of a config are described (a config holds plain values only, and no cycles: a bound)
CONFIG_DEPTH = 32


def is_config(value: Any) -> bool:
    """Whether ``value`` is an OmegaConf ``DictConfig`` or ``ListConfig`` (a Hydra config), told by its
    class's module: omegaconf is not imported here, so ``import autobatch`` does not need it."""
    return any(cls.__name__ in ("DictConfig", "ListConfig") and cls.__module__.startswith("omegaconf.")
               for cls in type(value).__mro__)


def _is_list(config: Any) -> bool:
    return any(cls.__name__ == "ListConfig" for cls in type(config).__mro__)


def config_child(config: Any, step: Any) -> Any:
    """The value at ``step`` of an OmegaConf config, read as the code reads it (``cfg.width`` and
    ``cfg["width"]`` alike), its interpolation resolved; :data:`MISSING` where the key is absent or
    mandatory and unset (``???``), or where its interpolation cannot resolve here (``${hydra:...}``
    outside a Hydra run): that setting is then not keyed, and the code meets the error itself if it reads it."""
    if _is_list(config):
        if not isinstance(step, int) or not -len(config) <= step < len(config):
            return MISSING
    elif not isinstance(step, (str, int)) or step not in config:
        return MISSING
    try:
        return config[step]
    except Exception as error:  # noqa: BLE001 - only OmegaConf's own (its resolution errors); others raise
        if not type(error).__module__.startswith("omegaconf"):
            raise
        return MISSING


def config_data(config: Any, leaf: Callable[[Any], Any], breadth: int | None = None, depth: int = 0) -> Any:
    """An OmegaConf config as JSON-able data, every level (a Hydra config nests ``cfg.model.encoder.layers``
    deeper than a closure's cells are followed): a ``DictConfig`` as a dict by key, a ``ListConfig`` as a
    list, each value resolved (:func:`config_child`; one that cannot be read here is left out) and each
    plain value by ``leaf``. ``breadth``: a list or dict longer than this by its length (a vocabulary)."""
    if not is_config(config):
        return leaf(config)
    keys = range(len(config)) if _is_list(config) else list(config.keys())
    if depth >= CONFIG_DEPTH or (breadth is not None and len(keys) > breadth):
        return {"class": type(config).__qualname__, "len": len(keys)}
    children = ((key, config_child(config, key)) for key in keys)
    data = {str(key): config_data(value, leaf, breadth, depth + 1) for key, value in children if value is not MISSING}
    return list(data.values()) if _is_list(config) else data
