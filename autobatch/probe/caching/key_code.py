"""How the probe cache's key reads code and values: by content, never by address.

:func:`_code_hash` hashes a function's code with the values it reads that its bytecode does not
hold (a closure's cells, a ``functools.partial``'s arguments, the globals it names, a bound
method's object); :func:`_describe` turns a value into JSON-able data that changes when the value
changes a step's memory (tensors by shape and dtype, modules by their tree and classes' code,
config objects by their public attributes, to :data:`DEPTH`, an OmegaConf config by its values:
:mod:`~autobatch.probe.caching.key_config`); :func:`_module_tree` describes a model.
:mod:`~autobatch.probe.caching.cache_key` builds the key from them.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import sys
import types
from typing import Any

import torch

from .key_backends import layout_of
from .key_config import config_data, is_config
from ..tracing.trace_state import closure_cells, nested_codes

__all__ = ["BREADTH", "DEPTH", "class_code", "data_code_hash", "own_code"]


def _hash_code(code: Any, digest: "hashlib._Hash") -> None:
    """Feed a code object into ``digest``: bytecode, names and constants, nested code objects
    (lambdas, generator expressions) by their content, never by their address."""
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            _hash_code(const, digest)
        elif isinstance(const, frozenset):  # `x in {"a", "b"}`: its repr's order follows the hash seed
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())


#: how deep the key follows a config object, a closure's cells or a partial's arguments
DEPTH = 3
#: containers longer than this are keyed by their length only
BREADTH = 64


def _code_hash(fn: Any, depth: int = 0, describe: Any = None) -> str:
    """A hash of ``fn``'s code and of the values it reads that its bytecode does not hold: a
    ``functools.partial``'s function and arguments, a bound method's object, a closure's cells,
    its default arguments (``lambda m, b, n=n_passes:``) and the plain globals its code names (a
    loss over ``n_passes`` keyed by its value). ``describe`` reads those values (default
    :func:`_describe`; ``make_batch``'s by :func:`_plain_data`: :func:`data_code_hash`)."""
    describe = describe or _describe
    if isinstance(fn, functools.partial):
        return _digest([_code_hash(fn.func, depth + 1, describe), describe(fn.args, depth + 1),
                        describe(fn.keywords, depth + 1)])
    if isinstance(fn, torch.nn.Module):  # a loss module: its classes' code and its tree, not Module.__call__
        return _digest(_describe(fn, depth))
    owner = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    call = getattr(type(fn), "__call__", None)
    if code is None and hasattr(call, "__code__") and not isinstance(fn, type):  # a callable object
        owner, fn, code = fn, call, call.__code__
    if code is None:  # a builtin: its name (its code is C)
        return getattr(fn, "__qualname__", type(fn).__qualname__)
    digest = hashlib.sha256()
    _hash_code(code, digest)
    cells = [value for _, value in closure_cells(fn)]
    reads = {"cells": describe(cells, depth + 1), "globals": _globals_read(fn, code, depth, describe)}
    defaults = [getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)]
    if any(defaults):  # (absent where there are none: the keys cached before stay)
        reads["defaults"] = describe(defaults, depth + 1)
    if owner is not None and not isinstance(owner, type):  # a loss module's method: by its tree too
        reads["self"] = describe(owner, depth + 1)
    digest.update(_canonical(reads).encode())
    return digest.hexdigest()[:16]


def data_code_hash(fn: Any) -> str:
    """``make_batch``'s code (a lambda, a ``functools.partial``, a bound method, a callable
    object, as :func:`_code_hash` reads them) with the plain data it reads (:func:`_plain_data`:
    a ``max_length`` it pads to, a dtype, a config's ``image_size``), not its tensors or what it
    memoises: the batches' shapes are keyed beside it, and a dict of batches it filled during a
    probe would make the next probe in the process miss."""
    return _code_hash(fn, 0, _plain_data)


def _plain_data(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data (:func:`data_code_hash`): numbers and strings, dtypes and devices
    by name, containers of them item by item, an object (a config, a data module) by its public
    attributes to :data:`DEPTH`, a function by its code; None for anything else (a tensor, a
    module, a generator, an iterator's state, an object of torch's or autobatch's own: a
    ``Runner`` whose step count would make a resumed run miss)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return _describe(value)
    if isinstance(value, (torch.dtype, torch.device, torch.Size, enum.Enum)):
        return str(value)
    if depth >= DEPTH or isinstance(value, (torch.Tensor, torch.nn.Module, type, types.ModuleType)) or _is_array(value):
        return None
    if is_config(value):  # a Hydra config's ``seq_len``, as a config object's (:func:`_describe`)
        return config_data(value, _describe, BREADTH)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if len(value) > BREADTH:  # a vocabulary by its length; a memo of batches, as below, by nothing
            first = [item for item, _ in zip(value.values() if isinstance(value, dict) else value, range(BREADTH))]
            data = any(_plain_data(item, depth + 1) is not None or item is None for item in first)
            return {"class": type(value).__qualname__, "len": len(value)} if data else ({} if isinstance(value, dict) else [])
        # items that are not data (the batches a memo dict holds) are left out, and so is their number
        if isinstance(value, dict):
            pairs = sorted(value.items(), key=lambda kv: str(kv[0]))
            return {str(key): data for key, item in pairs if (data := _plain_data(item, depth + 1)) is not None or item is None}
        items = [data for item in value if (data := _plain_data(item, depth + 1)) is not None or item is None]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if callable(value) and (hasattr(value, "__code__") or isinstance(value, functools.partial)):
        return {"code": _code_hash(value, depth + 1, _plain_data)}
    if _torchs(type(value).__module__):  # torch's and autobatch's own (a DataLoader, a Runner, a TrainerStep):
        return None                       # their code is keyed by the versions, their counters are no data
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and _keyed_object(value):
        public = {name: item for name, item in attributes.items() if not name.startswith("_")}
        return {"class": type(value).__qualname__, **{name: _plain_data(item, depth + 1) for name, item in public.items()}}
    return None


def _globals_read(fn: Any, code: Any, depth: int = 0, describe: Any = None) -> dict[str, Any]:
    """The globals ``code`` names that can change what it allocates: plain values (numbers,
    strings), containers (a config dict, a list of sizes) item by item, the functions of the
    user's code it calls, by their code (to :data:`DEPTH`), and objects by their state (a
    module-level dataclass config: :func:`_keyed_object`); not modules, classes or torch's own
    functions (keyed by torch's version). ``describe``: as :func:`_code_hash` takes it."""
    describe = describe or _describe
    names = {name for current in nested_codes(code) for name in current.co_names}
    scope = getattr(fn, "__globals__", {})
    read = {}
    for name in sorted(names):
        value = scope.get(name, _MISSING)
        if _is_plain(value):
            read[name] = describe(value, DEPTH - 1 if describe is _plain_data else DEPTH)
        elif isinstance(value, (dict, list, tuple, set, frozenset)):
            read[name] = describe(value, depth + 1)  # deeper in, less: a module's code reads modules
        elif _users_function(value) and value is not fn and depth + 1 < DEPTH:
            read[name] = {"code": _code_hash(value, depth + 1, describe)}
        elif _keyed_object(value):
            read[name] = describe(value, depth + 1)
    return read


def _keyed_object(value: Any) -> bool:
    """A global keyed by its state (:func:`_describe`: public attributes, to :data:`DEPTH`): a
    config object (a dataclass, ``SimpleNamespace``, ``argparse.Namespace``, any object of your
    code or a library's), an enum member, a tensor (by shape); not Python modules, classes,
    functions (keyed by code above) or the standard library's machinery (a logger, a lock),
    whose state is not the model's and differs from process to process."""
    if isinstance(value, (torch.Tensor, enum.Enum)):
        return True
    if isinstance(value, (types.ModuleType, type)) or hasattr(value, "__code__"):
        return False
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except AttributeError:  # a C object (a lock, an array): no attributes to key
        return False
    top = (type(value).__module__ or "").partition(".")[0]
    return isinstance(attributes, dict) and (top not in sys.stdlib_module_names or top in ("types", "argparse"))


_MISSING = object()


def _users_function(value: Any) -> bool:
    """A Python function (or partial) of the user's code: not torch's, not a builtin."""
    func = value.func if isinstance(value, functools.partial) else value
    return hasattr(func, "__code__") and not _torchs(getattr(func, "__module__", None))


def _torchs(module: str | None) -> bool:
    return bool(module) and (module == "torch" or module.startswith(("torch.", "torchvision.", "autobatch.")))


def class_code(cls: type, depth: int = 0) -> str:
    """A module class's code: every function the user's classes in its method order define
    (``forward`` and the helpers it calls, ``self.body``), with what they read; a class of
    torch's by its ``forward`` (its code is keyed by torch's version)."""
    parts = []
    for owner in cls.__mro__:
        if owner in (torch.nn.Module, object):
            break
        if _torchs(owner.__module__):
            forward = vars(owner).get("forward")
            parts.append([owner.__qualname__, _code_hash(forward, depth) if forward is not None else None])
            continue
        parts.append([owner.__qualname__, own_code(owner, depth)])
    return _digest(parts)


def own_code(cls: type, depth: int = 0) -> dict[str, str]:
    """The code of each function ``cls`` itself defines (not its bases'), with what it reads."""
    methods = {name: getattr(value, "__func__", value) for name, value in vars(cls).items()}
    return {name: _code_hash(method, depth) for name, method in sorted(methods.items()) if hasattr(method, "__code__")}


def _is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(item, _PLAIN) for item in value)
    return isinstance(value, _PLAIN)


def _digest(parts: Any) -> str:
    return hashlib.sha256(_canonical(parts).encode()).hexdigest()[:16]


def _canonical(data: Any) -> str:
    """The canonical JSON of ``data`` (sorted keys, no spaces; what JSON cannot hold as text)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def _describe(value: Any, depth: int = 0) -> Any:
    """JSON-able data that changes when ``value`` changes the answer: tensors by shape and dtype,
    containers item by item, a module (a criterion, a frozen teacher) by its tree and code, other
    objects by class and (to :data:`DEPTH`) their public attributes, a callable by its code."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "device": value.device.type, **layout_of(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not isinstance(value, float) or math.isfinite(value) else str(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)) and len(value) > BREADTH:
        return {"class": type(value).__qualname__, "len": len(value)}  # a vocabulary, a dataset: not item by item
    if isinstance(value, torch.nn.Module) and depth < DEPTH:  # a teacher or criterion the loss reads: not the model
        code = sorted({f"{type(m).__qualname__}:{class_code(type(m), depth + 1)}" for m in value.modules()})
        return {"class": type(value).__qualname__, "tree": _digest([_module_tree(value, depth), code])}
    if depth >= DEPTH or isinstance(value, (torch.nn.Module, type)):
        return type(value).__qualname__ if not isinstance(value, type) else value.__qualname__
    if is_config(value):  # a Hydra config: by its values (its attributes are private), every level
        return config_data(value, _describe, BREADTH)
    if isinstance(value, dict):
        return {str(key): _describe(item, depth + 1) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_describe(item, depth + 1) for item in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if callable(value) and (hasattr(value, "__code__") or isinstance(value, functools.partial)):
        return {"code": _code_hash(value, depth + 1)}
    if isinstance(value, enum.Enum):  # its attributes are private: by its name
        return {"class": type(value).__qualname__, "name": value.name}
    if _is_array(value):  # like a tensor: its repr holds its values (random ones differ every run)
        return {"shape": list(value.shape), "dtype": str(value.dtype), "device": "numpy"}
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        public = {name: item for name, item in attributes.items() if not name.startswith("_")}
        return {"class": type(value).__qualname__, **{name: _describe(item, depth + 1) for name, item in public.items()}}
    shown = repr(value)
    return {"class": type(value).__qualname__, "repr": shown if " at 0x" not in shown else None}


def _is_array(value: Any) -> bool:
    """A NumPy array of one or more dimensions (NumPy is not imported for it)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray) and value.ndim > 0



_PLAIN = (bool, int, float, str, type(None))


def _module_tree(model: torch.nn.Module, depth: int = 0) -> dict[str, Any]:
    """Each module's class and settings, parameters and buffers by shape and dtype, and the blocks
    whose forward is replaced on the instance (activation checkpointing: another memory profile)."""
    return {
        "modules": [[name, type(module).__qualname__, _settings(module, depth)] for name, module in model.named_modules()],
        "parameters": [[name, list(p.shape), str(p.dtype), p.requires_grad, *layout_of(p).values()]
                       for name, p in model.named_parameters()],
        "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()],
        "checkpointed": sorted(name for name, module in model.named_modules() if "forward" in module.__dict__),
    }


def _settings(module: torch.nn.Module, depth: int = 0) -> dict[str, Any]:
    """A module's public attributes (``num_heads``, ``training``, a config object's fields...), its
    plain private ones (``self._reps``; not torch's: ``torch.compile``'s wrapper holds an address) and
    its class's plain ones: what shapes its activations beside its parameters' shapes and its code."""
    settings = {}
    for name, value in vars(type(module)).items():
        if not name.startswith("_") and _is_plain(value):
            settings[f"class.{name}"] = _describe(value)
    ours = not _torchs(type(module).__module__)
    for name, value in vars(module).items():
        if name.startswith("_"):
            if ours and _is_plain(value) and not name.startswith("__"):
                settings[name] = _describe(value)
            continue
        if callable(value) and not hasattr(value, "__dict__"):
            continue
        settings[name] = _describe(value, depth + 1)
    return settings
