"""Trials at learning rate 0: when a step leaves the weights bit for bit as they are, and the
hooks that keep it so (:mod:`~autobatch.probe.snapshot.restore`'s ``zero_lr`` snapshot copies no weight).

A fresh optimizer of a kind whose every change to a parameter is scaled by its group's learning
rate (``AdamW``, ``SGD``, ...) steps at learning rate 0 without moving a weight, building its
state and allocating every temporary of a real step; :func:`steps_in_place_at_zero_lr` says
when that holds, the gradients are zeroed before each such step (:func:`_zero_grads`), and
:class:`_VersionsInStep` tells the optimizer's own writes from a forward's.
"""

from __future__ import annotations

from typing import Any

import torch

from ...memory.lazy_state import hooked
from .shards import local

__all__ = ["steps_in_place_at_zero_lr"]


class _VersionsInStep:
    """How far each of an optimizer's parameters' version counters moved inside its ``step()``
    calls (at learning rate 0 the step writes them, unchanged): a move outside was a write by
    something else, which the snapshot did not copy.

    A step that raised (a trial out of memory inside ``AdamW.step()``) runs no post-hook, so
    its window stays open until the next step begins or :meth:`remove`: the step's own writes
    are counted as the step's, not blamed on the forward. Writes in that window that are not
    the step's (the next trial's forward) are counted with it; the first trial's forward
    comes before any step, so a forward that writes on every call is still seen."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.bumps: dict[int, int] = {}
        self.before: dict[int, int] | None = None  # the versions where the open step began
        inner = hooked(optimizer)
        self.handles = [inner.register_step_pre_hook(self.enter), inner.register_step_post_hook(self.leave)]

    def enter(self, *_: Any) -> None:
        self.leave()  # a step that raised left its window open: what it wrote was its own
        self.before = {id(p): p._version for p in self.params}

    def leave(self, *_: Any) -> None:
        if self.before is None:
            return
        for p in self.params:
            self.bumps[id(p)] = self.bumps.get(id(p), 0) + p._version - self.before.get(id(p), p._version)
        self.before = None

    def remove(self) -> None:
        self.leave()
        for handle in self.handles:
            handle.remove()


#: optimizers whose every change to a parameter, weight decay included, is scaled by the group's
#: ``lr`` (read in torch's source: ``p.add_(u, alpha=-lr)``, ``p.mul_(1 - lr * wd)``); their state
#: is built lazily at the first step. Exact types only: a subclass may step otherwise.
_SCALED_BY_LR = tuple(
    getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop")
    if hasattr(torch.optim, name)
)


def steps_in_place_at_zero_lr(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether a step of ``optimizer`` at learning rate 0 leaves its parameters bit for
    bit as they are, and restoring its state needs no copy: a type in ``_SCALED_BY_LR``, no
    state yet, float learning rates, and floating weights that are finite and hold no negative
    zero (``-0.0 + 0.0`` is ``+0.0``). Two kernels that a training step does not load (an
    integer minimum, a fused norm), the verdict read on the host: loading kernels on their first
    use is most of what this check costs (0.07-0.10 s on an H200 for the version with five
    kernels, 4-5 ms when they were loaded already; ``scripts/diag_zero_lr_check.py``)."""
    if optimizer is None or type(optimizer) not in _SCALED_BY_LR or any(optimizer.state.values()):
        return False
    if any(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
        return False
    weights: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensor = local(param).detach()
            if tensor.dtype not in _NEGATIVE_ZERO:
                return False  # not a float type whose negative zero we can spot
            if tensor.numel():
                weights.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for (_, dtype), found in weights.items():
            kind, bits = _NEGATIVE_ZERO[dtype]
            # a negative zero's bits are the integer type's smallest value: one minimum per
            # tensor and one fused norm (NaN / inf: not finite), both read on the host
            smallest = torch.stack([w.view(kind).amin() for w in found]).cpu()
            norms = torch.stack(torch._foreach_norm(found, 2)).cpu()
            if bool((smallest == bits).any()) or not bool(norms.isfinite().all()):
                return False
    return True


#: a float type's negative zero as the bit pattern of the same-sized integer type
_NEGATIVE_ZERO = {
    torch.float32: (torch.int32, -(2**31)), torch.float64: (torch.int64, -(2**63)),
    torch.bfloat16: (torch.int16, -(2**15)), torch.float16: (torch.int16, -(2**15)),
}


def _zero_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Every group's learning rate to 0: the trials' steps build state but move no weight."""
    for group in optimizer.param_groups:
        group["lr"] = 0.0


def _zero_grads(optimizer: torch.optim.Optimizer) -> None:
    """Before a step at learning rate 0: every gradient set to zero in place, so no NaN or
    infinity reaches an update (``0 * nan``) and every update term is a zero; the step's memory
    and kernels are the same. One fused kernel per device and type (zeroing only the non-finite
    values cost a kernel per tensor: ~3 ms of every ResNet-50 step on an H200)."""
    dense: list[torch.Tensor] = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = local(param.grad)
                    if grad.is_sparse:
                        grad._values().zero_()
                    else:
                        dense.append(grad)
        if dense:
            torch._foreach_zero_(dense)
