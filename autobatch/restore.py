"""Snapshot a model and its optimizer before trials that really train, and put them back.

Probe trials run real optimizer steps, so without a restore the model a user probes is not
the model they start training (Lightning users hit leaked optimizer state, #6570). The
snapshot lives in CPU memory so it takes nothing from the device being probed, and is taken
outside any simulated budget. Restoring is bit-exact: parameters, buffers, gradients,
optimizer state (including state that did not exist yet, such as Adam's moments before the
first step), training flags and the random number generators.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Snapshot"]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return copy.deepcopy(value)


@dataclass
class Snapshot:
    """What :meth:`take` copied; :meth:`restore` writes it back in place."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    training: dict[str, bool] = field(default_factory=dict)
    optimizer_state: dict[str, Any] | None = None
    rng_cpu: torch.Tensor | None = None
    rng_cuda: list[torch.Tensor] | None = None

    @classmethod
    def take(cls, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> "Snapshot":
        snap = cls(model=model, optimizer=optimizer)
        if model is not None:
            for name, tensor in _named_state(model):
                snap.tensors[name] = tensor.detach().to("cpu", copy=True)
            for name, param in model.named_parameters():
                snap.grads[name] = None if param.grad is None else param.grad.detach().to("cpu", copy=True)
            snap.training = {name: module.training for name, module in model.named_modules()}
        if optimizer is not None:
            snap.optimizer_state = _to_cpu(optimizer.state_dict())
        snap.rng_cpu = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            snap.rng_cuda = torch.cuda.get_rng_state_all()
        return snap

    def restore(self) -> None:
        """Write the snapshot back into the same objects (their identity is preserved)."""
        with torch.no_grad():
            if self.model is not None:
                for name, tensor in _named_state(self.model):
                    tensor.copy_(self.tensors[name])
                for name, param in self.model.named_parameters():
                    saved = self.grads.get(name)
                    param.grad = None if saved is None else saved.to(param.device, copy=True)
                for name, module in self.model.named_modules():
                    module.training = self.training.get(name, module.training)
        if self.optimizer is not None and self.optimizer_state is not None:
            # load_state_dict replaces the whole state, so state created during the trials
            # (Adam moments that did not exist before) disappears again; it casts tensors
            # back to each parameter's device.
            self.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        torch.set_rng_state(self.rng_cpu)
        if self.rng_cuda is not None:
            torch.cuda.set_rng_state_all(self.rng_cuda)


def _named_state(model: torch.nn.Module):
    yield from model.named_parameters()
    yield from ((name, buf) for name, buf in model.named_buffers() if buf is not None)
