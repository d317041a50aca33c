"""The settings a plain callable reads through a container or a config object, keyed by the path its
code reads them at: ``cfg["width"]`` of a config dict at module level or in its closure,
``args.seq_len`` of an ``argparse.Namespace``, ``self.cfg["width"]`` on a bound method's or callable
object's ``self``. Before review 37 only a setting the code named itself was keyed
(:func:`~autobatch.probe.caching.cache_key._settings_read`), and a config dict's wider width under
the same ``cache_key`` was served the narrower one's answer (959 where 314 fits). Only the paths
read are keyed, not the whole container or object: the model, the list of losses or the logger
beside them would make every call miss, and so would a counter the code writes
(``stats["calls"] += 1``, ``stats.calls = n``), whose path is left out. An OmegaConf ``DictConfig``
(a Hydra config: ``cfg.model.width``, ``cfg["width"]``) is read by key too
(:func:`~autobatch.probe.caching.key_config.config_child`); before review 38 it was not, neither a dict nor an object with the setting in its ``__dict__``, and a wider
config under the same ``cache_key`` was served the narrower one's answer.
"""

from __future__ import annotations

import dis
from typing import Any, Iterator

import torch

from .key_code import _describe, _keyed_object, _torchs
from .key_config import MISSING as _MISSING, config_child, is_config

__all__ = ["paths_read"]

#: a path step: ("attr", name) for ``.name``, ("item", key) for ``[key]`` with a constant key
Path = tuple[tuple[str, Any], ...]


#: the loads a path starts from, and the root each names (Python 3.12's LOAD_FAST_CHECK, 3.14's LOAD_FAST_BORROW
#: are LOAD_FAST; a module-level LOAD_NAME is LOAD_GLOBAL)
_LOADS = {"LOAD_GLOBAL": "LOAD_GLOBAL", "LOAD_NAME": "LOAD_GLOBAL", "LOAD_DEREF": "LOAD_DEREF", "LOAD_FAST": "LOAD_FAST",
          "LOAD_FAST_CHECK": "LOAD_FAST", "LOAD_FAST_BORROW": "LOAD_FAST"}
#: how an augmented assignment (``x["k"] += 1``) keeps its target: Python 3.11's and later, 3.10's
_COPIES = ("COPY", "DUP_TOP", "DUP_TOP_TWO")


def _subscript(op: Any) -> bool:
    """``x[k]`` read: ``BINARY_SUBSCR``, or Python 3.14's ``BINARY_OP`` of ``[]``."""
    return op.opname == "BINARY_SUBSCR" or (op.opname == "BINARY_OP" and op.argrepr == "[]")


def _chains(code: Any) -> Iterator[tuple[Any, Path, bool]]:
    """``(load instruction, path, written)`` for each name the code loads and the constant
    attributes and subscripts it follows from it; ``written``: the path is assigned or updated
    in place there (``x.a = v``, ``x["k"] = v``, ``x["k"] += 1``)."""
    ops = list(dis.get_instructions(code))
    for index, load in enumerate(ops):
        if load.opname not in _LOADS:
            continue
        path: list[tuple[str, Any]] = []
        at = index + 1
        while at < len(ops):
            if ops[at].opname == "LOAD_ATTR":
                path.append(("attr", ops[at].argval))
                at += 1
            elif (ops[at].opname == "LOAD_CONST" and isinstance(ops[at].argval, (str, int))
                  and at + 1 < len(ops) and _subscript(ops[at + 1])):
                path.append(("item", ops[at].argval))
                at += 2
            else:
                break
        yield load, tuple(path), False
        after = [op.opname for op in ops[at:at + 2]] + ["", ""]
        if after[0] == "STORE_ATTR" or (after[0] in _COPIES and after[1] == "LOAD_ATTR"):
            yield load, (*path, ("attr", ops[at + (0 if after[0] == "STORE_ATTR" else 1)].argval)), True
        elif after[0] == "LOAD_CONST" and after[1] in ("STORE_SUBSCR", "DELETE_SUBSCR", *_COPIES):
            yield load, (*path, ("item", ops[at].argval)), True


def _resolve(value: Any, path: Path) -> Any:
    """What ``path`` reaches from ``value`` through dicts, lists and tuples by item, through
    config objects (:func:`~autobatch.probe.caching.key_code._keyed_object`) by their ``__dict__``
    (no property runs, no ``defaultdict`` grows) and through OmegaConf configs by key
    (:func:`~autobatch.probe.caching.key_config.config_child`); not through torch's objects or modules."""
    for kind, step in path:
        if is_config(value):
            value = config_child(value, step)
            if value is _MISSING:
                return _MISSING
        elif kind == "item":
            if isinstance(value, dict) and step in value:
                value = value[step]
            elif isinstance(value, (list, tuple)) and isinstance(step, int) and -len(value) <= step < len(value):
                value = value[step]
            else:
                return _MISSING
        else:
            if (isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, dict, list, tuple))
                    or not _keyed_object(value) or _torchs(type(value).__module__)):
                return _MISSING
            attributes = object.__getattribute__(value, "__dict__")
            if step not in attributes:
                return _MISSING
            value = attributes[step]
    return value


def paths_read(codes: list[Any], roots: dict[tuple[str, str], tuple[str, Any]], setting: Any,
               min_steps: int = 1) -> dict[str, Any]:
    """The settings (``setting(value)`` true) the code objects ``codes`` read by a path of at least
    ``min_steps`` steps from a root: ``roots`` maps ``(load opname, name)`` to ``(label, value)``, such as
    ``("LOAD_GLOBAL", "cfg")`` to ``("global cfg", the dict)``. Keyed as ``label`` and the path
    (``global cfg['width']``); a path the code also writes, or one below it, is left out."""
    read: dict[tuple[tuple[str, str], Path], None] = {}
    written: set[tuple[tuple[str, str], Path]] = set()
    for code in codes:
        for load, path, is_written in _chains(code):
            root = (_LOADS[load.opname], load.argval)
            if root in roots and len(path) >= min_steps:
                (written.add((root, path)) if is_written else read.setdefault((root, path)))
    found = {}
    for root, path in read:
        if any(root == other and path[:len(stem)] == stem for other, stem in written):
            continue
        label, value = roots[root]
        value = _resolve(value, path)
        if value is not _MISSING and setting(value):
            steps = "".join(f".{step}" if kind == "attr" else f"[{step!r}]" for kind, step in path)
            found[f"{label}{steps}"] = _describe(value)
    return found
