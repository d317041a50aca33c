"""What a fake-tensor trace may write outside the modules it swaps, and putting it back.

A step traced under ``FakeTensorMode`` (the estimate, :mod:`~autobatch.probe.tracing.fake_trace`;
the cache key's fake batches, :mod:`~autobatch.probe.caching.cache_key`) runs the user's code, which
may keep what it computes where no module attribute holds it: a helper object the model owns
(``self.rope = SimpleNamespace(cos=...)``), a dict in a closure, at class level or at module
level, a module global it rebinds (``global MASK``), a class attribute it rebinds or adds
(``type(self).calls += 1``), a ``functools.lru_cache`` of a function
it calls. Left there,
those fake tensors reach the real trials, which then compute with tensors that hold no data
(a probe answered 511 where 340 trains, and cached it). :class:`OutsideState` records all of
it before the trace and puts it back after: objects' attributes and containers' items
reachable from the step (as :func:`find_fake` walks them, from the model, the loss, the batch
maker, the optimizer, the user's classes and the globals their code reads), the globals'
bindings, and it clears
every ``lru_cache`` that computed something during the trace (a cache is safe to clear).
Iterators (a DataLoader's, whose state also lives in its workers) and autobatch's own objects
are left alone. :func:`find_fake` then tells where a fake is still reachable.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["OutsideState", "class_members", "closure_cells", "code_globals", "code_references", "find_fake", "nested_codes", "SEARCH_BUDGET", "SEARCH_ITEMS"]

#: Values the walks never look inside.
ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, torch.dtype, torch.device)
#: Objects a walk visits at most, and the largest container it looks inside (a dataset in a
#: closure could hold millions of items): what lies beyond is neither restored nor checked.
SEARCH_BUDGET = 100_000
SEARCH_ITEMS = 10_000
#: How many calls deep :func:`code_globals` follows the user's functions (as the cache key does).
CODE_DEPTH = 3
_MISSING = object()
#: The containers whose items are put back (subclasses too, copied into the plain type: a
#: module's hooks are ``OrderedDict``s).
CONTAINERS = (dict, list, set, deque)
#: Callables whose own attributes are not state (their closures and defaults are walked).
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial,
         functools._lru_cache_wrapper, staticmethod, classmethod, property)


def snapshot(obj: Any) -> tuple[Any, type, dict[str, Any], dict[str, Any]]:
    """``obj``, its class, its attributes (shallow) and a copy of each container among them
    (a module's parameters, buffers, submodules and hooks are dicts)."""
    attributes = dict(object.__getattribute__(obj, "__dict__"))
    contents = {name: _copy(value) for name, value in attributes.items() if isinstance(value, CONTAINERS)}
    return obj, type(obj), attributes, contents


def restore(obj: Any, cls: type, attributes: dict[str, Any], contents: dict[str, Any]) -> None:
    """Put back what :func:`snapshot` saw: the class (a lazy module becomes its eager class
    when first run), attributes added removed, replaced ones back, containers' items back."""
    if type(obj) is not cls:
        obj.__class__ = cls
    current = object.__getattribute__(obj, "__dict__")
    for name in [name for name in current if name not in attributes]:
        del current[name]
    for name, value in attributes.items():
        if current.get(name, _MISSING) is not value:
            current[name] = value
    for name, saved in contents.items():
        put_back_items(attributes[name], saved)


def _copy(container: Any) -> Any:
    if isinstance(container, dict):
        return dict(container)
    return set(container) if isinstance(container, set) else list(container)


def put_back_items(container: Any, saved: Any) -> None:
    """Give ``container`` the items of its copy ``saved`` again, where it holds others (by identity)."""
    if len(container) == len(saved):
        if isinstance(container, dict):
            if all(key in container and container[key] is value for key, value in saved.items()):
                return
        elif isinstance(container, set) and container == saved:
            return
        elif not isinstance(container, set) and all(a is b for a, b in zip(container, saved)):
            return
    container.clear()
    (container.update if isinstance(container, (dict, set)) else container.extend)(saved)


class OutsideState:
    """Everything reachable from ``roots`` (and the globals ``functions``' code reads) that a
    trace could change outside the modules in ``skip`` (whose attributes the caller puts back
    itself): taken at construction, put back by :meth:`put_back`."""

    def __init__(self, roots: dict[str, Any], functions: Iterable[Any] = (), skip: Iterable[Any] = (),
                 classes: Iterable[type] = ()) -> None:
        self.bindings: list[tuple[dict[str, Any], str, Any]] = []
        #: the user's classes among ``classes`` (and their bases) and their attributes: a class-level counter
        #: forward rebinds (``type(self).calls += 1``) is put back, what it adds to the class removed
        self.classes = [(owner, dict(vars(owner))) for owner in _user_classes(classes)]
        self.globals = code_globals(functions, self.bindings)
        self.roots = {**roots, **self.globals}
        self.objects: list[tuple[Any, type, dict[str, Any], dict[str, Any]]] = []
        self.containers: list[tuple[Any, Any]] = []
        self.caches: list[tuple[Any, tuple[int, int]]] = []
        skipped = {id(value) for value in skip}
        for value in _reachable(self.roots.values()):
            if isinstance(value, functools._lru_cache_wrapper):
                self.caches.append((value, _cache_state(value)))
            elif isinstance(value, CONTAINERS):
                self.containers.append((value, _copy(value)))
            elif id(value) not in skipped and not isinstance(value, _CODE) and _attributes(value) is not None:
                self.objects.append(snapshot(value))

    def put_back(self) -> list[str]:
        """Put back every binding, object and container as found; clear the ``lru_cache``\\ s that
        computed something since. Returns the names of the caches cleared."""
        for scope, name, value in self.bindings:
            if value is _MISSING:
                scope.pop(name, None)
            elif scope.get(name, _MISSING) is not value:
                scope[name] = value
        for owner, attributes in self.classes:
            for name in [name for name in vars(owner) if name not in attributes]:
                delattr(owner, name)
            for name, value in attributes.items():
                if vars(owner).get(name, _MISSING) is not value:
                    setattr(owner, name, value)
        for saved in reversed(self.objects):
            restore(*saved)
        for container, saved in self.containers:
            put_back_items(container, saved)
        cleared = []
        for cache, before in self.caches:
            if _cache_state(cache) != before:
                cache.cache_clear()
                cleared.append(getattr(cache, "__qualname__", repr(cache)))
        self.bindings, self.objects, self.containers, self.caches, self.classes = [], [], [], [], []
        return cleared


def _cache_state(cache: Any) -> tuple[int, int]:
    info = cache.cache_info()
    return info.misses, info.currsize


def _attributes(value: Any) -> dict[str, Any] | None:
    try:  # never through a __getattr__ of its class
        attributes = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None
    return attributes if isinstance(attributes, dict) else None


def _left_alone(value: Any) -> bool:
    """Not walked into: a tensor (its data is not state a trace writes), an iterator (a
    DataLoader's: its position also lives in its workers, so its attributes cannot be rolled
    back alone), autobatch's own objects (the probe's bookkeeping) and the standard library's
    machinery other than containers, functions and namespaces (a logger's registry gains the
    loggers of modules the trace imports first: rolled back, they would be orphaned)."""
    if isinstance(value, torch.Tensor) or hasattr(type(value), "__next__"):
        return True
    module = getattr(type(value), "__module__", None) or ""
    top = module.partition(".")[0]
    return top == "autobatch" or (top in sys.stdlib_module_names and top not in _STDLIB_WALKED)


#: The standard library's modules whose objects are walked: containers, functions, partials,
#: cached functions, ``SimpleNamespace``, ``argparse.Namespace``.
_STDLIB_WALKED = {"builtins", "collections", "types", "functools", "argparse"}


def _reachable(roots: Iterable[Any], leaf: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Each object reachable from ``roots`` once, as :func:`find_fake` follows them, not into
    what :func:`_left_alone` names, within :data:`SEARCH_BUDGET`. ``leaf``: objects yielded
    although left alone (a ``random.Random``), and not looked into."""
    seen: set[int] = set()
    queue, budget = deque(roots), SEARCH_BUDGET
    while queue and budget:
        value = queue.popleft()
        if isinstance(value, ATOMS) or id(value) in seen:
            continue
        if leaf is not None and leaf(value):
            seen.add(id(value))
            yield value
            continue
        if _left_alone(value):
            continue
        seen.add(id(value))
        budget -= 1
        if isinstance(value, CONTAINERS) and len(value) > SEARCH_ITEMS:
            continue
        yield value
        queue.extend(child for child, _ in _children(value, ""))


def _function_of(value: Any) -> Any:
    """The Python function behind ``value`` (a partial's, a method's, a cached function's, a
    callable object's ``__call__``), or None."""
    for _ in range(4):
        if isinstance(value, types.FunctionType):
            return value
        if isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, (types.MethodType, staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, functools._lru_cache_wrapper):
            value = getattr(value, "__wrapped__", None)
        elif callable(value) and not isinstance(value, (type, torch.nn.Module)):
            value = getattr(type(value), "__call__", None)
        else:
            return None
    return None


def _torchs(value: Any) -> bool:
    module = getattr(value, "__module__", None) or getattr(type(value), "__module__", None) or ""
    return module == "torch" or module.startswith(("torch.", "autobatch."))


def nested_codes(code: Any) -> Iterator[Any]:
    """``code`` and every code object nested in it (its inner functions, lambdas, comprehensions)."""
    stack = [code]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(const for const in current.co_consts if hasattr(const, "co_code"))


def closure_cells(fn: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of each filled closure cell of the function ``fn``, in order (a cell not yet
    assigned is left out); empty for anything without code. Every walk that follows what a function
    closes over reads its cells so."""
    found = []
    for name, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:  # a cell not yet assigned
            continue
    return found


def code_references(value: Any, library: Callable[[types.FunctionType], bool]) -> Iterator[tuple[str, Any]]:
    """What a ``functools.partial``, a bound method or a Python function holds or names, as ``(name,
    object)``: ``""`` for the callable's own parts (a partial's function and positional arguments, a
    method's function and object), a keyword's, closure cell's or global's name otherwise; nothing for a
    function ``library`` says is a library's, or for any other value. One walk for the callers that
    follow a ``loss_fn`` to what it reaches (:mod:`autobatch.planning.loss_reduction`,
    :mod:`autobatch.training.loss_writes`)."""
    if isinstance(value, functools.partial):
        yield "", value.func
        yield from (("", arg) for arg in value.args)
        yield from value.keywords.items()
    elif isinstance(value, types.MethodType):
        yield "", value.__func__
        yield "", value.__self__
    elif isinstance(value, types.FunctionType) and not library(value):
        yield from closure_cells(value)
        names = {n for code in nested_codes(value.__code__) for n in code.co_names}
        yield from ((n, value.__globals__[n]) for n in sorted(names) if n in value.__globals__)


def _names(code: Any) -> tuple[set[str], set[str]]:
    """The names ``code`` (and the code nested in it) reads, and the globals it assigns."""
    names, stored = set(), set()
    for current in nested_codes(code):
        names.update(current.co_names)
        stored.update(ins.argval for ins in dis.get_instructions(current)
                      if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"))
    return names, stored


def code_globals(functions: Iterable[Any], bindings: list | None = None) -> dict[str, Any]:
    """The globals the code of ``functions`` names, and of the user's functions those call (to
    :data:`CODE_DEPTH`), by ``"global module.NAME"``: not Python modules, classes, plain values
    or torch's own, but a ``torch.Generator`` (:func:`~autobatch.probe.snapshot.rng.own_generators`).
    ``bindings`` gets ``(globals dict, name, value)`` of each global read or assigned (a missing
    one as a marker), so a rebinding (``global MASK``) can be undone."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    stack = [(fn, 0) for fn in functions]
    while stack:
        fn, depth = stack.pop()
        fn = _function_of(fn)
        if fn is None or id(fn) in seen or depth > CODE_DEPTH or _torchs(fn):
            continue
        seen.add(id(fn))
        scope = fn.__globals__
        names, stored = _names(fn.__code__)
        for name in sorted(names):
            value = scope.get(name, _MISSING)
            if bindings is not None and (value is not _MISSING or name in stored):
                bindings.append((scope, name, value))
            if value is _MISSING or isinstance(value, ATOMS) or _torchs(value) and not isinstance(value, torch.Generator):
                continue
            found.setdefault(f"global {scope.get('__name__', '?')}.{name}", value)
            stack.append((value, depth + 1))
    return found


def _user_classes(classes: Iterable[type]) -> list[type]:
    """The classes among ``classes`` and their bases below ``torch.nn.Module`` that are not torch's, each once."""
    found: dict[type, None] = {}
    for cls in classes:
        for owner in cls.__mro__:
            if owner in (torch.nn.Module, object):
                break
            if not _torchs(owner):
                found.setdefault(owner)
    return list(found)


def class_members(classes: Iterable[type]) -> dict[str, Any]:
    """What the user's classes among ``classes`` define, by ``"class Name.attr"``: the functions
    (and cached functions) their ``forward`` runs, whose globals :func:`code_globals` reads, and
    the class-level state they may keep (``_masks = {}`` shared by every instance). torch's
    classes are left out, and so are dunder names and plain values."""
    found: dict[str, Any] = {}
    for owner in _user_classes(classes):
        for name, value in vars(owner).items():
            if not (name.startswith("__") and name.endswith("__")) and not isinstance(value, ATOMS):
                found[f"class {owner.__qualname__}.{name}"] = value.fget if isinstance(value, property) else value
    return found


def find_fake(roots: dict[str, Any], is_fake: Callable[[torch.Tensor], bool]) -> str | None:
    """The path of the nearest fake tensor (``is_fake``) reachable from ``roots``, or of a real
    tensor holding one as its gradient, or None. Every such gradient is dropped (a fake is
    never left on a real tensor). Follows attributes, container items (and tensor keys),
    closures, defaults, ``functools.partial``, bound methods and tensors' gradient hooks."""
    seen: set[int] = set()
    queue = deque((value, name) for name, value in roots.items())
    budget, found = SEARCH_BUDGET, None
    while queue and budget:
        value, path = queue.popleft()
        if isinstance(value, ATOMS) or id(value) in seen:
            continue
        seen.add(id(value))
        budget -= 1
        if isinstance(value, torch.Tensor):
            if is_fake(value):
                found = found or path
                continue
            if value.is_leaf and value._grad is not None and is_fake(value._grad):
                value.grad = None
                found = found or f"{path}.grad"
            queue.extend((hook, f"{path}._backward_hooks[{key}]") for key, hook in (value._backward_hooks or {}).items())
        else:
            queue.extend(_children(value, path))
    return found


def _children(value: Any, path: str) -> Iterator[tuple[Any, str]]:
    """``(child, path)`` of what :func:`find_fake` follows from ``value``."""
    if isinstance(value, (dict, list, tuple, set, frozenset, deque)) and len(value) > SEARCH_ITEMS:
        return
    if isinstance(value, dict):
        for key, item in list(value.items()):
            label = repr(key) if isinstance(key, (str, int)) else f"<{type(key).__name__} key>"
            yield item, f"{path}[{label}]"
            if isinstance(key, torch.Tensor):
                yield key, f"{path}{label}"
    elif isinstance(value, (list, tuple, set, frozenset, deque)):
        yield from ((item, f"{path}[{i}]") for i, item in enumerate(list(value)))
    elif isinstance(value, types.FunctionType):
        yield from ((cell, f"{path}.<closure {name}>") for name, cell in closure_cells(value))
        yield from ((item, f"{path}.<default {i}>") for i, item in enumerate(value.__defaults__ or ()))
        yield from ((item, f"{path}.<default {k}>") for k, item in (value.__kwdefaults__ or {}).items())
    elif isinstance(value, types.MethodType):
        yield value.__self__, f"{path}.__self__"
        yield value.__func__, path
    elif isinstance(value, functools.partial):
        yield value.func, f"{path}.func"
        yield from ((item, f"{path}.args[{i}]") for i, item in enumerate(value.args))
        yield from ((item, f"{path}.keywords[{k!r}]") for k, item in value.keywords.items())
    attributes = _attributes(value)
    if attributes is not None and not isinstance(value, (types.FunctionType, types.MethodType)):
        for name, item in list(attributes.items()):
            if isinstance(value, torch.nn.Module) and name in ("_parameters", "_buffers", "_modules"):
                yield from ((child, f"{path}.{key}") for key, child in list(item.items()))
            else:
                yield item, f"{path}.{name}"
