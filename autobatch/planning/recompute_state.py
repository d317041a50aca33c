"""State a checkpointed block's forward writes, kept so its recompute in backward changes nothing.

Backward runs a checkpointed block's forward a second time (:mod:`.checkpointing`). Two kinds
of ``torch.nn`` state are written by a forward in training mode:

* running statistics (``track_running_stats``: BatchNorm, InstanceNorm): the recompute would
  update them twice per micro-batch. Their owners normalise with the batch's statistics, so the
  recomputed activations are the same whatever the buffers hold.
* spectral norm's power-iteration vectors (``torch.nn.utils.parametrizations.spectral_norm``'s
  ``_u`` / ``_v``, the older ``torch.nn.utils.spectral_norm``'s ``<name>_u`` / ``<name>_v``):
  every forward runs a power iteration from them. The recompute started from the vectors the
  forward had just updated, so it built *another* weight (``W / sigma`` with another ``sigma``)
  and backward differentiated that one: a checkpointed spectral-norm block trained a gradient
  1e-5 off the plain one, and ran two power iterations per micro-batch, without a word.

So the forward's context snapshots these buffers before the forward, and the recompute's
context loads that snapshot for the recompute (the same iteration, the same weight) and puts
back what the forward left once it is done (also when it stops early). Each micro-batch then
updates them once, as without checkpointing. Anything else a forward writes (a buffer or a
Python counter of the user's own) still runs twice.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

#: the hook ``torch.nn.utils.spectral_norm`` (the older form) registers; the module's name is
#: shadowed by the function of that name on ``torch.nn.utils``
_LegacySpectralNorm = importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm

__all__ = ["writes_state", "recompute_contexts", "spectral_norm_layers"]


def _spectral_buffers(owner: nn.Module) -> list[torch.Tensor]:
    """The power-iteration vectors ``owner``'s forward updates now (training mode), if any."""
    if not owner.training:
        return []
    if type(owner).__name__ == "_SpectralNorm" and type(owner).__module__ == "torch.nn.utils.parametrizations":
        return [owner._u, owner._v]
    found = []
    for hook in owner._forward_pre_hooks.values():  # torch.nn.utils.spectral_norm: a pre-hook on the layer
        if isinstance(hook, _LegacySpectralNorm):
            found += [getattr(owner, f"{hook.name}_u"), getattr(owner, f"{hook.name}_v")]
    return found


def spectral_norm_layers(model: nn.Module) -> list[str]:
    """``model``'s layers whose forward runs a spectral-norm power iteration now, as
    ``"name: Class"`` (a parametrization is named by the layer it parametrizes)."""
    names = []
    for name, layer in model.named_modules():
        listed = layer.parametrizations if torch.nn.utils.parametrize.is_parametrized(layer) else {}
        owners = [layer, *(p for ps in listed.values() for p in ps)]
        if any(_spectral_buffers(owner) for owner in owners) and type(layer).__name__ != "_SpectralNorm":
            names.append(f"{name or 'the model'}: {type(layer).__name__.removeprefix('Parametrized')}")
    return names


def _written(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module``'s modules that its forward writes now (see the module doc)."""
    buffers: list[torch.Tensor] = []
    for owner in module.modules():
        if owner.training and getattr(owner, "track_running_stats", False) is True:
            buffers += [b for b in owner.buffers(recurse=False) if b is not None]
        buffers += _spectral_buffers(owner)
    return buffers


def writes_state(module: nn.Module) -> bool:
    """Whether ``module``'s forward writes any of the state this module keeps."""
    return bool(_written(module))


def recompute_contexts(module: nn.Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s ``context_fn`` for ``module``: a pair sharing one snapshot, taken around
    the forward and used around the recompute."""
    kept = _Kept(module)
    return kept.forward(), kept.recompute()


class _Kept:
    """One checkpointed call's snapshot of the written buffers before its forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.before: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextlib.contextmanager
    def forward(self) -> Any:
        self.before = [(b, b.detach().clone()) for b in _written(self.module)]
        yield

    @contextlib.contextmanager
    def recompute(self) -> Any:
        after = [(b, b.detach().clone()) for b, _ in self.before]
        with torch.no_grad():
            for buffer, value in self.before:
                buffer.copy_(value)
        try:
            yield
        finally:  # also when the recompute stops early (non-reentrant checkpoint raises to stop it)
            with torch.no_grad():
                for buffer, value in after:
                    buffer.copy_(value)
