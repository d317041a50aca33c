"""What else the cache keys a step by: process-wide kernel choices and tensor layouts.

Beside the model, the optimizer and the inputs (:mod:`~autobatch.probe.caching.cache_key`), a step's
memory depends on which attention kernels ``scaled_dot_product_attention`` may use (with the
fused ones off it keeps its score matrix) and on whether 4-d tensors are stored channels-last
(convolutions pick other kernels and workspaces), on which kernels CUDA may pick (cuDNN off,
deterministic algorithms), and on how each compiled module was compiled
(``torch.compile``'s backend, mode and options: CUDA graphs keep their own memory pool).
"""

from __future__ import annotations

from typing import Any

import torch

from ..tracing.trace_state import closure_cells

__all__ = ["attention_backends", "compile_settings", "cuda_kernel_settings", "layout_of"]


def attention_backends() -> dict[str, bool]:
    """Which ``scaled_dot_product_attention`` kernels are switched on (``enable_flash_sdp``,
    ``sdpa_kernel``; CPU and CUDA alike): with the fused ones off, attention keeps its score
    matrix, and a tenth of the batch fit in a test."""
    names = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")
    return {name: bool(getattr(torch.backends.cuda, name)()) for name in names if hasattr(torch.backends.cuda, name)}


def cuda_kernel_settings() -> dict[str, bool]:
    """The process-wide switches that choose other CUDA kernels, and so other workspaces, where
    they are off their defaults (nothing where none is: the keys cached before stay):
    ``torch.backends.cudnn.enabled = False`` (convolutions in PyTorch's own kernels, which unfold
    their input into a buffer), ``cudnn.deterministic`` and ``torch.use_deterministic_algorithms``
    (other algorithms, other scratch memory). ``cudnn.benchmark`` is keyed on every device."""
    switched = {
        "cudnn_enabled": bool(torch.backends.cudnn.enabled),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }
    defaults = {"cudnn_enabled": True, "cudnn_deterministic": False, "deterministic_algorithms": False}
    return {name: value for name, value in switched.items() if value != defaults[name]}


def layout_of(tensor: torch.Tensor) -> dict[str, str]:
    """``{"layout": "channels_last"}`` for a 4-d tensor stored channels-last (convolutions pick
    other kernels and workspaces), else nothing: the keys of other tensors stay as they were."""
    last = tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)
    return {"layout": "channels_last"} if last else {}


#: how many wrappers deep :func:`compile_settings` looks for ``torch.compile``'s backend
_WRAPPERS = 8


def compile_settings(model: torch.nn.Module) -> list[list[Any]]:
    """``[name, settings]`` for each module of ``model`` that is compiled, as a wrapper
    (``torch.compile(model)``) or in place (``model.compile()``, which leaves the module tree as
    it was): the backend, its mode's options (``reduce-overhead``: CUDA graphs with their own
    memory pool; ``max-autotune``), ``dynamic`` and ``fullgraph``; empty for an eager model."""
    found = []
    for name, module in model.named_modules():
        compiled = module.__dict__.get("_compiled_call_impl")
        context = module.__dict__.get("dynamo_ctx") if compiled is None else _context_of(compiled)
        if compiled is not None or context is not None:
            found.append([name, _compiler_of(context)])
    return found


def _context_of(fn: Any) -> Any:
    """The ``torch._dynamo`` context a compiled function closes over (it holds the backend)."""
    for _, value in closure_cells(fn):
        if hasattr(value, "callback") and hasattr(value, "fullgraph"):
            return value
    return None


def _compiler_of(context: Any) -> dict[str, Any]:
    """The backend behind ``context`` (through the wrappers dynamo puts around it) by its plain
    settings: ``compiler_name``, ``config`` (the mode's options), ``dynamic``, ``kwargs``."""
    settings: dict[str, Any] = {"fullgraph": _plain(getattr(context, "fullgraph", None))}
    backend = getattr(context, "callback", None)
    for _ in range(_WRAPPERS):
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "_torchdynamo_orig_callable", None)
        if inner is None or inner is backend:
            break
        backend = inner
    owner = type(backend) if not hasattr(backend, "__qualname__") else backend  # a backend function of your own
    settings["backend"] = getattr(backend, "compiler_name", None) or f"{owner.__module__}.{owner.__qualname__}"
    for name in ("config", "dynamic", "kwargs"):
        if hasattr(backend, name):
            settings[name] = _plain(getattr(backend, name))
    return settings


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data: numbers and strings as they are, containers item by item,
    anything else by its class (never its address)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return getattr(value, "__qualname__", type(value).__qualname__)
