"""Build a config's ``_target_`` objects (model, optimizer, dataset) with errors that name the key.

Hydra reports a constructor that rejects a value as "Error in call to target '...':
ValueError(...)", which names neither the config key nor the override that set the value.
:func:`construct` turns it into one ``ValueError`` line naming both (bad input, exit status 2);
an exception that is not about the arguments (out of memory, an error in the user's code)
is raised as it is. A constructor that cannot open what a value names (``root: /missing``:
``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``) is bad input too: the same
one line, naming the key and the path.
"""

from __future__ import annotations

from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from .errors import one_line

__all__ = ["construct"]

#: The exceptions a constructor raises for a value it rejects: bad input, exit status 2.
_REJECTED = (ValueError, TypeError, IndexError, KeyError, AssertionError)
#: A path among its arguments that does not exist, is not a directory, or may not be read:
#: bad input as well (a wrong ``root``), not a failure at run time.
_UNOPENABLE = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
#: The other keys whose value reaches a group's constructor (``optimizer.lr`` is ``train.lr``).
_FED_BY = {"optimizer": ("train.lr",)}


def _overrides_of(key: str) -> list[str]:
    """The command line's overrides that set ``key`` 's values (``key=option``, ``key.x=``,
    ``+key.x=``, and the keys in :data:`_FED_BY`); empty outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    keys = (key, *_FED_BY.get(key, ()))
    return [
        override for override in HydraConfig.get().overrides.task
        if override.lstrip("+~").split("=", 1)[0].split("@", 1)[0] in keys
        or override.lstrip("+~").startswith(tuple(f"{k}." for k in keys))
    ]  # fmt: skip


def construct(key: str, node: Any, **kwargs: Any) -> Any:
    """``instantiate(node)`` for the config key ``key`` (``model``, ``optimizer``,
    ``data.dataset``). A value its constructor rejects (``optimizer.betas=[0.9]``,
    ``train.lr=-1``, ``model.dropout=1.5``) is one ``ValueError`` line naming ``key``, its
    ``_target_`` and the command line's overrides of it, instead of Hydra's "Error in call to
    target"; any other exception (out of memory, an error in the user's code) is raised as it
    is. A path it cannot open (``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``)
    is reported the same way."""
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if not isinstance(cause, (*_REJECTED, *_UNOPENABLE)):
            if cause is not None:
                raise cause from None
            raise
        target = node.get("_target_") if hasattr(node, "get") else None
        given = _overrides_of(key)
        fix = f"check {' '.join(given)}" if given else f"check the {key} keys (python -m autobatch probe --cfg job)"
        what = "could not open a path it was given" if isinstance(cause, _UNOPENABLE) else "rejected its arguments"
        raise ValueError(f"{key}: {target} {what} ({type(cause).__name__}: {one_line(cause)}); {fix}") from None
