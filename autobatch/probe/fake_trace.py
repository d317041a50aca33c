"""The fake world a step is traced in: fake copies of the model's tensors and optimizer.

:class:`FakeWorld` swaps a :class:`~autobatch.TrainStep`'s parameters, buffers and
optimizer state for fake tensors (one fake per real tensor, so tied weights stay tied) for
the duration of a trace, and puts the real ones back; the user's model and optimizer are
never written to. :func:`resident_bytes` is what the real tensors already hold on the device.
Used by :mod:`autobatch.probe.estimate`.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .train_step import TrainStep

__all__ = ["FakeWorld", "TraceScaler", "resident_bytes"]


class TraceScaler:
    """Stands in for a ``GradScaler`` while tracing: same memory (a scaled loss, in-place
    unscaling of gradients allocates nothing), but no ``.item()`` on fake tensors."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 65536.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """In place, as the real one (before gradient clipping): no allocation beyond a flag."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(1 / 65536.0)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass


def _tensors_of(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_of(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_of(item)


def resident_bytes(step: TrainStep, device: torch.device, round_to: int) -> int:
    """Bytes of the distinct storages of parameters, buffers and optimizer state on ``device``."""
    seen: dict[int, int] = {}
    tensors = list(step.model.parameters()) + [b for b in step.model.buffers() if b is not None]
    tensors += list(_tensors_of(list(step.optimizer.state.values())))
    for tensor in tensors:
        if tensor.device.type != device.type:
            continue
        storage = tensor.untyped_storage()
        seen[storage._cdata] = -(-storage.nbytes() // round_to) * round_to
    return sum(seen.values())


class FakeWorld:
    """Fake copies of a step's model state and optimizer, swapped in while tracing."""

    def __init__(self, step: TrainStep, mode: FakeTensorMode) -> None:
        self.step = step
        self.mode = mode
        self.memo: dict[int, torch.Tensor] = {}
        self.swapped: list[tuple[dict, str, torch.Tensor]] = []

    def fake(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)
        if key not in self.memo:
            self.memo[key] = self.mode.from_tensor(tensor)
        return self.memo[key]

    def swap_in(self) -> None:
        for module in self.step.model.modules():
            for slots in (module._parameters, module._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is not None:
                        self.swapped.append((slots, name, tensor))
                        slots[name] = self.fake(tensor)

    def swap_out(self) -> None:
        for slots, name, tensor in reversed(self.swapped):
            slots[name] = tensor
        self.swapped.clear()

    def optimizer(self) -> torch.optim.Optimizer:
        """A shallow copy of the optimizer over the fake parameters, with fake state."""
        real = self.step.optimizer
        fake_opt = copy.copy(real)
        fake_opt.__dict__.pop("step", None)  # an LR scheduler's patched step is bound to ``real``
        groups = []
        for group in real.param_groups:
            fake_group = dict(group)
            fake_group["params"] = [self.fake(p) for p in group["params"]]
            if group.get("foreach", False) is None and not group.get("fused"):
                # the default is decided from the real tensors' type and device; fake tensors
                # would always get the per-tensor loop
                fake_group["foreach"] = _default_foreach(group["params"])
            groups.append(fake_group)
        fake_opt.param_groups = groups
        state: defaultdict = defaultdict(dict)
        for param, param_state in real.state.items():
            state[self.fake(param)] = {key: self._state_value(value) for key, value in param_state.items()}
        fake_opt.state = state
        return fake_opt


    def _state_value(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        if value.dim() == 0:
            # a step counter that the optimizer reads with .item(): a fake tensor made from a
            # Python number keeps its value, one made from a real tensor does not
            number = value.item()
            with self.mode:
                return torch.tensor(number, dtype=value.dtype, device=value.device)
        return self.fake(value)


def _default_foreach(params: list[torch.Tensor]) -> bool:
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])
    except Exception:  # noqa: BLE001 - a private helper; the loop is a fine default
        return False
