"""The probe cache's key: everything that changes a probe's answer, as JSON-able data.

:func:`key_components` describes a :class:`~autobatch.TrainStep` (its model, code, inputs,
optimizer, precision, clipping, how a compiled module was compiled), the device, the versions
and the probe's settings; :func:`key_of` hashes them (:mod:`~autobatch.probe.caching.cache` stores one
entry per key). The code of the loss and of every module class (each method a user's class
defines, ``forward`` of torch's) and of ``make_batch`` is keyed by content, with the values it reads that are not in its bytecode: a
closure's cells, a ``functools.partial``'s arguments, the globals it names (plain values,
containers of them such as a config dict, the functions it calls, followed to :data:`DEPTH`,
and objects by their public attributes, such as a module-level dataclass or ``SimpleNamespace``
config), a bound method's object; a module the loss is or reads (a criterion, a frozen
teacher) by its parameters' shapes, settings and classes' code; each module by its settings
(plain private ones too: ``self._reps``), including those of a config object it holds
(``self.config.n_passes``) and of its class, and by the code of the hooks registered on it.
How code and values are read: :mod:`~autobatch.probe.caching.key_code`.
"""

from __future__ import annotations

import dis
import functools
import hashlib
from typing import Any, Callable, Mapping

import torch

from ...memory.allocator import expandable_segments, other_allocator_settings
from ...version import __version__, code_fingerprint
from .key_backends import attention_backends, compile_settings, cuda_kernel_settings
from .key_batches import sample_batches
from .key_config import config_data, is_config
from .key_reads import paths_read
from .key_code import (  # noqa: F401 - re-exported: tests and integrations import them from here
    BREADTH, DEPTH, _canonical, _code_hash, _describe, _hash_code, _is_array, _module_tree, class_code, data_code_hash,
    own_code,
)
from ..tracing.trace_state import closure_cells, nested_codes
from ..train_step import TrainStep

__all__ = ["CAPACITY_STEP", "STATE_HYPERPARAMETERS", "callable_components", "key_components", "key_of", "own_code",
           "step_components", "class_code", "sample_batches"]

#: Device capacity enters the key in steps of this many bytes.
CAPACITY_STEP = 64 * 1024**2
#: Optimizer hyperparameters that change the optimizer's state or its temporaries.
STATE_HYPERPARAMETERS = (
    "momentum", "nesterov", "dampening", "amsgrad", "foreach", "fused", "capturable",
    "differentiable", "centered", "weight_decay", "decoupled_weight_decay",
    "maximize",  # the step negates each gradient into a new tensor: the largest gradient more at the peak
)


# -- the key --------------------------------------------------------------------------------
def user_key(value: Any) -> Any:
    """A ``cache_key`` as JSON-able data, every item at every depth: it names the work (a
    flattened config of 100 keys, a width four levels down), so unlike a closure's cells it is
    not cut at :data:`DEPTH` or :data:`BREADTH`; an OmegaConf config (``cache_key=cfg.model``) by its
    values, as a dict (:mod:`.key_config`); what is not a container, by :func:`_describe`."""
    if is_config(value):
        return config_data(value, user_key)
    if isinstance(value, dict):
        return {str(key): user_key(item) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [user_key(item) for item in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    return user_key(value.tolist()) if _is_array(value) else _describe(value)


def _inputs(make_batch: Callable[[int], Any], batches: tuple[Any, Any] | None = None) -> Any:
    """Shapes and dtypes of batches of 1 and 2 (``batches``, where already built)."""
    return [_describe(batch) for batch in (batches if batches is not None else sample_batches(make_batch))]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else list(value.shape)
    return value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


def _optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """The optimizer's class (with its module and code: a user's ``Adam`` is not torch's) and,
    for each group, which parameters it trains (by name in the model, else shape and dtype:
    Adam over the head or over the body holds different state) and the settings that change
    its state or temporaries."""
    names = {id(param): name for name, param in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        settings = {name: _plain(group[name]) for name in STATE_HYPERPARAMETERS if name in group}
        for name in ("momentum", "weight_decay"):  # only whether it is on changes memory
            if name in settings and isinstance(settings[name], (int, float)):
                settings[name] = bool(settings[name])
        params = [names.get(id(p), [list(p.shape), str(p.dtype)]) for p in group["params"]]
        groups.append({"params": params, **settings})
    # a custom optimizer may keep a parameter's state as one bare tensor, or a tensor of its own at the
    # state's top level (self.state["count"] = ...): counted as one (Tensor.values() raised on them)
    state_tensors = sum(
        1 for state in optimizer.state.values()
        for value in (state.values() if isinstance(state, Mapping) else (state,)) if isinstance(value, torch.Tensor)
    )
    cls = type(optimizer)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "code": class_code(cls), "groups": groups,
            "state_tensors": state_tensors}


def _forward_code(model: torch.nn.Module) -> list[str]:
    """The code of every module class in ``model`` (a forward edited under the same tree misses)."""
    return sorted(f"{cls.__qualname__}:{class_code(cls)}" for cls in {type(module) for module in model.modules()})


def step_components(step: TrainStep, batches: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """The parts of the key that describe a :class:`TrainStep` (``batches``: its
    :func:`sample_batches`, where already built)."""
    model = step.model
    return {
        "model": _module_tree(model),
        "code": {
            "loss_fn": _code_hash(step.loss_fn),
            # what it builds beyond the two sample batches' shapes: a max_length it pads to,
            # a dtype or a channel count it chooses for larger batches (keyed as the loss is)
            "make_batch": None if step.make_batch is None else data_code_hash(step.make_batch),
            "forward": _forward_code(model),
            "hooks": _hooks(model),
            "step": type(step).__qualname__,
        },
        "inputs": _inputs(step.make_batch, batches),
        "optimizer": _optimizer(step.optimizer, model),
        "precision": {
            "autocast": str(step.autocast_dtype) if step.autocast_dtype is not None else None,
            "grad_scaler": None if step.grad_scaler is None else type(step.grad_scaler).__qualname__
            + ("" if getattr(step.grad_scaler, "is_enabled", lambda: True)() else " (disabled)"),
        },
        "clipping": step.max_grad_norm,  # clip_grad_norm_ allocates the norms of every gradient
        **({"compiled": compiled} if (compiled := compile_settings(model)) else {}),  # eager: as before
    }


def callable_components(fn: Any, restore: tuple[Any, ...] | None) -> dict[str, Any]:
    """What keys a plain callable beside its ``cache_key``: its own code (bytecode, names and constants,
    so an edited ``torch.randn(n, 64)`` misses) and, where ``restore`` names them, each module by its tree
    and classes' code and each optimizer by its class and what it trains, as a ``TrainStep``'s are keyed.
    Before, only the ``cache_key`` was: a model made wider under the same key was served the narrower
    one's answer, and training at it ran out of memory. The settings its code reads (a sequence length in its
    closure, at module level, or on a bound method's or callable object's ``self``: :func:`_settings_read`), not the other values its closure holds (a
    list of losses it appends to, a step counter: every call would miss)."""
    func = fn.func if isinstance(fn, functools.partial) else fn
    func = getattr(func, "__func__", func)  # a bound method: its function
    settings: dict[str, Any] = {}
    if hasattr(func, "__code__"):
        digest = hashlib.sha256()
        _hash_code(func.__code__, digest)
        code: Any = digest.hexdigest()[:16]
        settings = _settings_read(fn, func)
    else:  # a callable object: its class's code, and its settings (a partial's arguments, its attributes)
        code, settings = own_code(type(func)), _settings_read(fn, func)
    modules = [item for item in restore or () if isinstance(item, torch.nn.Module)]
    described: list[Any] = []
    for item in restore or ():
        if isinstance(item, torch.nn.Module):
            described.append({"model": _module_tree(item), "forward": _forward_code(item)})
        elif isinstance(item, torch.optim.Optimizer):
            described.append({"optimizer": _optimizer(item, modules[0] if modules else torch.nn.Module())})
        else:  # an LR scheduler, a GradScaler: by class
            described.append(type(item).__qualname__)
    return {"callable": code, **({"restore": described} if described else {}), **({"settings": settings} if settings else {})}


def _setting(value: Any) -> bool:
    """An immutable plain value a callable may size its work by: a number, a string, a dtype, a
    device, a tuple (a shape) of them; not a list or dict it may append to, not an object."""
    if isinstance(value, tuple):
        return all(map(_setting, value))
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


def _settings_read(fn: Any, func: Any) -> dict[str, Any]:
    """The settings (:func:`_setting`) a plain callable's code reads from its closure, the globals it
    names and a ``functools.partial``'s arguments, by name: ``torch.randn(n, seq_len, width)`` with
    ``seq_len`` in a closure or at module level made 4x the activations under the same ``cache_key``,
    and was served the shorter sequence's answer (training at it ran out of memory). Not a name the
    code rebinds (``nonlocal calls; calls += 1``, ``global step``: a counter would miss every call),
    nor containers or objects (a list of losses it appends to)."""
    found: dict[str, Any] = {}
    code = getattr(func, "__code__", None)  # None: a callable object, keyed by its attributes
    codes = list(nested_codes(code)) if code else []  # walked once, for every read below
    rebound = {ins.argval for current in codes for ins in dis.get_instructions(current)
               if ins.opname in ("STORE_DEREF", "DELETE_DEREF", "STORE_GLOBAL", "DELETE_GLOBAL")}
    for name, value in sorted(closure_cells(func), key=lambda item: item[0]):
        if name not in rebound and _setting(value):
            found[f"cell {name}"] = _describe(value)
    scope = getattr(func, "__globals__", {})
    for name in sorted({name for current in codes for name in current.co_names}):
        if name in scope and name not in rebound and _setting(scope[name]):
            found[f"global {name}"] = _describe(scope[name])
    if isinstance(fn, functools.partial):
        found.update({f"argument {index}": _describe(value) for index, value in enumerate(fn.args) if _setting(value)})
        found.update({f"keyword {name}": _describe(value) for name, value in fn.keywords.items() if _setting(value)})
    return {**found, **_attributes_read(fn.func if isinstance(fn, functools.partial) else fn),
            **_paths_read(fn, func, code, codes, rebound)}


def _paths_read(fn: Any, func: Any, code: Any, codes: list[Any], rebound: set[str]) -> dict[str, Any]:
    """The settings the code reads inside a container or config object (:mod:`.key_reads`): a
    global's or a cell's (``cfg["width"]``, ``args.seq_len``), a ``partial``'s argument's, and one
    of ``self``'s attributes' (``self.cfg["width"]``) for a bound method or a callable object.
    ``codes``: ``code`` and the code nested in it (``nested_codes``, empty where ``code`` is None)."""
    roots = {("LOAD_DEREF", name): (f"cell {name}", value)
             for name, value in closure_cells(func) if name not in rebound}
    scope = getattr(func, "__globals__", {})
    roots.update({("LOAD_GLOBAL", name): (f"global {name}", scope[name]) for current in codes
                  for name in current.co_names if name in scope and name not in rebound})
    found = paths_read(codes, roots, _setting)
    owner = getattr(fn.func if isinstance(fn, functools.partial) else fn, "__self__", None)
    top = code
    if owner is None and code is None:  # a callable object: its __call__, on itself
        owner, top = func, getattr(getattr(type(func), "__call__", None), "__code__", None)
    fast: dict[tuple[str, str], tuple[str, Any]] = {}
    if isinstance(fn, functools.partial) and code is not None:
        fast.update({("LOAD_FAST", name): (f"argument {name}", value)
                     for name, value in zip(code.co_varnames[int(owner is not None):code.co_argcount], fn.args)})
        fast.update({("LOAD_FAST", name): (f"keyword {name}", value) for name, value in fn.keywords.items()})
    if top is not None:
        found.update(paths_read([top], fast, _setting))
        if owner is not None and top.co_argcount:  # self.x is keyed by _attributes_read: here self.x[...] and deeper
            found.update(paths_read([top], {("LOAD_FAST", top.co_varnames[0]): ("self", owner)}, _setting, 2))
    return found


def _attributes_read(fn: Any) -> dict[str, Any]:
    """The settings (:func:`_setting`) a bound method's object or a callable object holds as attributes
    (``self.seq_len``), by name: ``Step(seq_len=512)`` was served ``Step(seq_len=128)``'s answer under
    the same ``cache_key`` (only the class's code was keyed). Not an attribute a method other than
    ``__init__`` assigns (``self.calls += 1``: a counter would miss every call)."""
    owner = getattr(fn, "__self__", None) if hasattr(fn, "__func__") else None if hasattr(fn, "__code__") else fn
    if owner is None or isinstance(owner, type) or not hasattr(owner, "__dict__"):
        return {}
    codes = [getattr(getattr(value, "__func__", value), "__code__", None)
             for cls in type(owner).__mro__ for name, value in vars(cls).items() if name != "__init__"]
    rebound = {ins.argval for code in codes if code is not None for current in nested_codes(code)
               for ins in dis.get_instructions(current) if ins.opname in ("STORE_ATTR", "DELETE_ATTR")}
    return {f"attribute {name}": _describe(value) for name, value in sorted(vars(owner).items())
            if name not in rebound and _setting(value)}


#: the hooks a module may hold: a forward hook that keeps activations changes the memory
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
#: the hooks a parameter may hold (``register_hook``, ``register_post_accumulate_grad_hook``)
PARAMETER_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")



def _hooks(model: torch.nn.Module) -> list[Any]:
    """The code of every hook registered on the model's modules and parameters, by name and
    kind (a gradient hook that keeps a copy; a post-accumulate-grad hook that steps and frees
    each gradient in backward)."""
    found = []
    for name, module in model.named_modules():
        for kind in HOOKS:
            hooks = getattr(module, kind, None) or {}
            found += [[name, kind, _code_hash(hook)] for hook in hooks.values()]
    for name, param in model.named_parameters():
        for kind in PARAMETER_HOOKS:
            hooks = getattr(param, kind, None) or {}
            found += [[name, kind, _code_hash(hook)] for hook in hooks.values()]
    return found


def key_components(
    fn: Any,
    *,
    cache_key: Any = None,
    restore: tuple[Any, ...] | None = None,
    device: str,
    capacity: int | None,
    memory_limit: int | None,
    probe: dict[str, Any],
    batches: tuple[Any, Any] | None = None,
) -> dict[str, Any] | None:
    """Everything that changes a probe's answer, as JSON-able data; None when ``fn`` is a plain
    callable without a ``cache_key`` (nothing to key on; with one, also its code and what
    ``restore`` holds: :func:`callable_components`). ``batches``: a ``TrainStep``'s
    :func:`sample_batches`, where already built."""
    if isinstance(fn, TrainStep):
        components = step_components(fn, batches)
    elif cache_key is not None:
        components = callable_components(fn, restore)
    else:
        return None
    if cache_key is not None:
        components["user_key"] = user_key(cache_key) if not isinstance(cache_key, str) else cache_key
    components["device"] = {
        "name": device,
        "capacity_steps": None if capacity is None else capacity // CAPACITY_STEP,
        "memory_limit": memory_limit,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),  # autotuned workspaces change the answer
        "attention": attention_backends(),
    }
    if device.startswith("cuda"):  # where free memory may sit decides what fits at the edge
        components["device"]["expandable_segments"] = expandable_segments()
        allocator = other_allocator_settings()
        if allocator:  # (absent where none is set: the keys cached before stay)
            components["device"]["allocator"] = allocator
        kernels = cuda_kernel_settings()
        if kernels:  # (absent where all are at their defaults)
            components["device"]["kernels"] = kernels
    components["versions"] = {"torch": torch.__version__, "autobatch": __version__, "code": code_fingerprint()}
    components["probe"] = dict(probe)
    return components


def key_of(components: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``components``."""
    return hashlib.sha256(_canonical(components).encode()).hexdigest()


