"""Which attribute names a model's forward code reads: a carried state read back, or a write-only cache.

:mod:`.carried_state` finds tensors a module keeps between forwards, sized by a micro-batch. A
recurrent state read back by the next forward (``self.rnn(x, self.hidden)``) trains each piece on
another's samples; a cache forward only writes (``self.last_attn = attn.detach()``, kept for
plotting) is harmless, and warning for it told its owner to rewrite a model that was right.

:func:`forward_reads` tells them apart from the code, not by running it: the attribute names
loaded (``LOAD_ATTR``, ``LOAD_METHOD``) and the strings named (``getattr(self, "hidden")``) by
every function a forward can reach: each module's ``forward`` and forward hooks, the methods of
the model's module classes they name (``self._step()``), the Python functions they call by a
global or closure name, nested functions and lambdas; torch's own code is not followed. A store
(``self.last_attn = ...``) is no read. It costs nothing while training (one pass over the
bytecode, at the first step trained in pieces, only where such a tensor exists: 0.1 ms for a
small GRU model, 15 ms for a 4-layer GPT-2 of transformers, whose CPU step took 1.4 s). The
alternatives cost more and miss more: watching the next forward's ops for the tensor (a
``TorchDispatchMode``: that GPT-2's step took 18 % longer under an empty one, nn's 4-layer
TransformerEncoder's 49 %) needs the runner to hold the warning to the next step and does not
mix with ``torch.compile``; saved-tensor hooks miss reads under ``no_grad`` and ops that
save no input. A read this misses (the state read by code outside the model's classes and the
functions they call, or a name built at run time) goes unwarned; a name read anywhere reachable
(a method that returns the cache for plotting, called from forward) counts as read, so where it
cannot tell it warns. A forward that is no Python code (a scripted module) counts as reading all.
"""

from __future__ import annotations

import dis
import functools
import types
from typing import Any

import torch

from ..probe.tracing.trace_state import closure_cells

__all__ = ["forward_reads"]

#: The most functions followed; past it every name counts as read (it warns rather than misses).
MAX_FUNCTIONS = 2000

_LOADS = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}


def _function(value: Any) -> types.FunctionType | None:
    """The Python function behind a callable (a bound method, a partial, a decorated one), if any."""
    for _ in range(8):
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, property):
            value = value.fget
        elif isinstance(getattr(value, "__wrapped__", None), types.FunctionType):  # functools.wraps
            value = value.__wrapped__
        else:
            break
    return value if isinstance(value, types.FunctionType) else None


def _torch_code(fn: types.FunctionType) -> bool:
    return (fn.__module__ or "").split(".")[0] == "torch"


def _scan(code: types.CodeType, names: set[str], globals_: set[str]) -> None:
    """Add the attribute names ``code`` loads and the strings it names to ``names``, the global
    names it loads to ``globals_``; nested code (lambdas, inner functions) too."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in _LOADS and isinstance(instruction.argval, str):
            names.add(instruction.argval)
        elif instruction.opname == "LOAD_GLOBAL" and isinstance(instruction.argval, str):
            globals_.add(instruction.argval.removeprefix("NULL + "))
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, types.CodeType):
            _scan(const, names, globals_)


def forward_reads(model: torch.nn.Module) -> set[str] | None:
    """The attribute names the forward code of ``model`` can read (module docstring); None where it
    cannot tell (a forward that is no Python code, or more than :data:`MAX_FUNCTIONS` functions)."""
    modules = list(model.modules())
    methods: dict[str, list[Any]] = {}  # what a name loaded may call on a module: self._step(), a property
    for klass in {klass for module in modules for klass in type(module).__mro__}:
        for name, value in vars(klass).items():
            methods.setdefault(name, []).append(value)
    hooks = dict(torch.nn.modules.module._global_forward_pre_hooks)
    hooks.update(torch.nn.modules.module._global_forward_hooks)
    roots: list[Any] = list(hooks.values())
    for module in modules:
        roots.append(vars(module).get("forward") or type(module).forward)
        roots.extend([*module._forward_pre_hooks.values(), *module._forward_hooks.values()])
    queue = []
    for root in roots:
        fn = _function(root) or _function(getattr(type(root), "__call__", None))
        if fn is None:
            return None  # a scripted or compiled-in forward: its reads are not in Python code
        queue.append(fn)
    names: set[str] = set()
    seen: set[types.FunctionType] = set()
    while queue:
        fn = queue.pop()
        if fn in seen or _torch_code(fn):
            continue
        seen.add(fn)
        if len(seen) > MAX_FUNCTIONS:
            return None
        loaded, called = set(), set()
        _scan(fn.__code__, loaded, called)
        names |= loaded
        reached = [fn.__globals__.get(name) for name in called]
        reached += [value for name in loaded for value in methods.get(name, ())]
        reached += [value for _, value in closure_cells(fn)]
        queue.extend(f for f in map(_function, reached) if f is not None and f not in seen)
    return names

