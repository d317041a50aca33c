"""Sharded (``DTensor``) state as this rank's local shard: what snapshots, guards and checkpoints keep.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns parameters into ``DTensor`` s, and the
optimizer's state (Adam's moments) follows them. Copying such a tensor to the CPU with
``.to("cpu")`` gives another ``DTensor``; writing a plain CPU tensor back into one with
``copy_`` raises ``aten.copy_.default got mixed torch.Tensor and DTensor``. And gathering the
full tensor would cost a collective and a whole model's memory on every rank.

So everything that copies state in autobatch (:class:`~autobatch.probe.snapshot.restore.Snapshot`, the
runner's :class:`~autobatch.training.oom.step_guard.StepGuard`, the runner's checkpoints) keeps
each rank's **local shard** only (``DTensor.to_local()``, a plain tensor) and writes it back
into the local shard in place, or rebuilds the ``DTensor`` from it with the layout it had
(:class:`ShardSpec`). Nothing is gathered; no collective runs.

:func:`check_optimizer_after_sharding`: an optimizer built before ``fully_shard`` holds the
plain tensors it replaced, and the parameters it misses never train; one clear error instead.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch


def _dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` once something imported it, else None: no tensor can
    be a ``DTensor`` before that module is loaded (``fully_shard`` and ``distribute_tensor``
    load it), and importing it costs a process about a second (sympy, the sharding rules)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)

__all__ = ["is_dtensor", "local", "local_data", "ShardSpec", "Shard", "spec_of", "to_cpu_local", "from_cpu_local", "has_dtensors", "plain_state", "load_plain_state"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor`` (a sharded or replicated parameter, FSDP2's)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(value, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor`` 's local shard (a view; writes go into the
    ``DTensor``), else ``tensor`` itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`local` for reading and writing data outside autograd (no gradient flows through
    it): a ``DTensor`` 's local tensor itself, without ``to_local()`` 's autograd view (about
    10 us a tensor, which the runner's step guard paid for every parameter and optimizer state
    of every step: 15 ms a step for a 20-block decoder's 980 tensors)."""
    if is_dtensor(tensor):
        inner = getattr(tensor, "_local_tensor", None)
        return inner.detach() if isinstance(inner, torch.Tensor) else tensor.to_local().detach()
    return tensor.detach()


@dataclass(frozen=True)
class ShardSpec:
    """How a ``DTensor`` is laid out over its mesh, to rebuild it from a local shard."""

    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def rebuild(self, shard: torch.Tensor) -> torch.Tensor:
        """A ``DTensor`` with this layout whose local shard is ``shard`` (no communication)."""
        return _dtensor_class().from_local(shard, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


def spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    """The layout of a ``DTensor``, None for a plain tensor."""
    if not is_dtensor(tensor):
        return None
    return ShardSpec(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride()))


@dataclass
class Shard:
    """A CPU copy of one ``DTensor`` 's local shard, with its layout and its device."""

    local: torch.Tensor
    spec: ShardSpec
    device: torch.device


def to_cpu_local(value: Any, copy_other=lambda v: v) -> Any:
    """A CPU copy of ``value`` (tensors, dicts, lists, tuples of them): a ``DTensor`` becomes a
    :class:`Shard` of its local shard; other leaves go through ``copy_other``."""
    if is_dtensor(value):
        part = value.to_local()
        return Shard(part.detach().to("cpu", copy=True), spec_of(value), part.device)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: to_cpu_local(item, copy_other) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu_local(item, copy_other) for item in value)
    return copy_other(value)


def from_cpu_local(value: Any) -> Any:
    """A fresh copy of what :func:`to_cpu_local` returned: each :class:`Shard` a new ``DTensor``
    on its device, plain tensors cloned on the CPU (``load_state_dict`` moves them), other
    leaves deep-copied, so the copy shares nothing with ``value``."""
    if isinstance(value, Shard):
        return value.spec.rebuild(value.local.to(value.device, copy=True))
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: from_cpu_local(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(from_cpu_local(item) for item in value)
    return copy.deepcopy(value)


def has_dtensors(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (an FSDP2 / tensor-parallel model)."""
    return any(is_dtensor(param) for param in model.parameters())


# -- checkpoints: plain tensors and plain types, so weights_only=True loads them -------------------
def plain_state(state: Any) -> Any:
    """A state dict with every ``DTensor`` replaced by a CPU copy of this rank's local shard:
    plain tensors and plain types only (what ``torch.load(weights_only=True)`` accepts)."""
    if is_dtensor(state):
        return state.to_local().detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: plain_state(item) for key, item in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(plain_state(item) for item in state)
    return state


def load_plain_state(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy a :func:`plain_state` of ``module.state_dict()`` back into ``module`` in place
    (each ``DTensor`` 's local shard from this rank's saved shard). Keys or shapes that differ
    raise ``ValueError`` naming them."""
    current = module.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in current.items():
            target = local(tensor)
            if target.shape != saved[name].shape:
                raise ValueError(
                    f"the checkpoint's {name!r} has shape {tuple(saved[name].shape)}, this rank's shard "
                    f"{tuple(target.shape)}: resume with the same world size and sharding"
                )
            target.copy_(saved[name])


def optimizer_state_for(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """Turn a :func:`plain_state` of ``optimizer.state_dict()`` back into one
    ``optimizer.load_state_dict`` accepts: a state tensor shaped like its parameter's local
    shard becomes a ``DTensor`` laid out as that parameter. A custom optimizer's own state is
    kept as saved: a value at the state's top level (``self.state["count"] = tensor``, under a
    key that is no parameter's index) and a parameter's state that is one bare tensor, not a
    dict (``self.state[p] = buffer``), rebuilt as that parameter; before, such a sharded resume
    was refused ("invalid literal for int()", "'Tensor' object has no attribute 'items'")."""
    params = [param for group in optimizer.param_groups for param in group["params"]]

    def rebuilt(value: Any, param: torch.Tensor | None) -> Any:
        spec = spec_of(param) if param is not None else None
        if spec is not None and isinstance(value, torch.Tensor) and value.shape == local(param).shape:
            return spec.rebuild(value.to(local(param).device))
        return value

    state = {}
    for index, entries in saved.get("state", {}).items():
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if param is None:  # the optimizer's own value, no parameter's: kept as saved
            state[index] = entries
        elif isinstance(entries, dict):
            state[index] = {key: rebuilt(value, param) for key, value in entries.items()}
        else:
            state[index] = rebuilt(entries, param)
    return {**saved, "state": state}


__all__ += ["optimizer_state_for", "check_optimizer_after_sharding"]


def check_optimizer_after_sharding(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` when ``optimizer`` holds plain tensors that are no longer ``model`` 's
    parameters and misses sharded (DTensor) trainable parameters of the same shape: it was built
    before ``fully_shard`` replaced them (with the blocks sharded first and the root after it,
    it held the blocks' new DTensors and the root's old embedding and head, which then never
    trained, the loss going down all the same). Deterministic, so raised on every rank alike, before any vote."""
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    own = {id(p) for p in model.parameters()}
    stale = {tuple(p.shape) for key, p in held.items() if key not in own and not is_dtensor(p)}
    missed = [name for name, p in model.named_parameters()
              if p.requires_grad and id(p) not in held and is_dtensor(p) and tuple(p.shape) in stale]
    if missed:
        shown = ", ".join(missed[:4]) + (f" and {len(missed) - 4} more" if len(missed) > 4 else "")
        raise ValueError(
            f"the optimizer does not hold the sharded parameters {shown} but holds plain tensors of their shapes that "
            "are no longer the model's: it was built before fully_shard, which replaces each parameter with a sharded "
            "DTensor, so those parameters would never train. Build the optimizer after the last fully_shard call "
            "(the root's), e.g. torch.optim.AdamW(model.parameters())"
        )
