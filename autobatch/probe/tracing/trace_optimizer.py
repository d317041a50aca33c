"""The optimizer a trace steps: a copy of the step's optimizer over fake parameters, with fake state.

:func:`fake_optimizer` copies the optimizer with all its attributes (torch's ``__getstate__``, which
``copy.copy`` uses, keeps only ``defaults``, ``state`` and ``param_groups``: a custom optimizer's own
buffers and the step hooks would be lost, the step failing with an ``AttributeError`` or a hook's
allocations left out), then gives it fake param groups and state. An optimizer it holds (Lookahead's
base optimizer, Accelerate's ``AcceleratedOptimizer``'s) is faked the same way, sharing the fake
param groups and state where the wrapper shares the real ones: stepping the real one it holds would
step the real parameters, whose gradients the trace never makes, and leave its state out (a
Lookahead over AdamW would be estimated at 0.44 of its peak). What the copies share with the real optimizer
(a dict of its own that the step fills) is put back after the trace by
:class:`~autobatch.probe.tracing.trace_state.OutsideState`. Used by :class:`~autobatch.probe.tracing.fake_trace.FakeWorld`.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Callable

import torch

__all__ = ["fake_optimizer"]

#: Wrappers of wrappers are followed this deep at most.
_DEPTH = 4


def fake_optimizer(real: torch.optim.Optimizer, fake: Callable[[torch.Tensor], torch.Tensor],
                   scalar: Callable[[torch.Tensor], torch.Tensor]) -> torch.optim.Optimizer:
    """A copy of ``real`` over fake parameters with fake state: ``fake`` makes the one fake of a
    tensor, ``scalar`` the fake of a 0-dim tensor that keeps its number (a step counter the
    optimizer reads with ``.item()``, a hyperparameter given as a tensor)."""
    return _Faker(fake, scalar).optimizer(real, 0)


class _Faker:
    """Makes each fake once: a wrapper and the optimizer it holds share one fake param-group list
    and state dict where they share the real ones (Lookahead's ``param_groups``, Accelerate's properties)."""

    def __init__(self, fake: Callable[[torch.Tensor], torch.Tensor], scalar: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fake, self.scalar = fake, scalar
        #: id of a real optimizer, param-group list or state dict -> its fake (a wrapper shares them)
        self.made: dict[int, Any] = {}

    def optimizer(self, real: Any, depth: int) -> Any:
        if id(real) in self.made:
            return self.made[id(real)]
        fake_opt = copy.copy(real)
        fake_opt.__dict__.update(real.__dict__)  # its own attributes and step hooks; groups and state below
        fake_opt.__dict__.pop("step", None)  # an LR scheduler's patched step is bound to ``real``
        self.made[id(real)] = fake_opt
        if depth < _DEPTH:
            for key, value in real.__dict__.items():
                if isinstance(value, torch.optim.Optimizer):  # one it steps (Lookahead's base optimizer)
                    fake_opt.__dict__[key] = self.optimizer(value, depth + 1)
        fake_opt.param_groups = self._groups(real.param_groups)
        fake_opt.state = self._state(real.state)
        return fake_opt

    def _groups(self, real_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if id(real_groups) in self.made:
            return self.made[id(real_groups)]
        groups = []
        for group in real_groups:
            # a hyperparameter given as a tensor (``lr=torch.tensor(1e-3)``, tensor ``betas``) is
            # read by value (``value=1 - beta2``): a fake made from a real tensor has none
            fake_group = {key: self._hyperparameter(value) for key, value in group.items() if key != "params"}
            fake_group["params"] = [self.fake(p) for p in group["params"]]
            if group.get("foreach", False) is None and not group.get("fused"):
                # the default is decided from the real tensors' type and device; fake tensors
                # would always get the per-tensor loop
                fake_group["foreach"] = _default_foreach(group["params"])
            groups.append(fake_group)
        self.made[id(real_groups)] = groups
        return groups

    def _state(self, real_state: dict[Any, dict[str, Any]]) -> defaultdict:
        if id(real_state) in self.made:
            return self.made[id(real_state)]
        state: defaultdict = defaultdict(dict)
        for key, entry in real_state.items():
            # keyed by a parameter, or by what an optimizer of one's own chooses (``state["global"]``)
            fake_key = self.fake(key) if isinstance(key, torch.Tensor) else key
            # a dict per parameter, or a bare tensor (an optimizer of one's own: ``state[p] = buf``)
            state[fake_key] = ({name: self._state_value(value) for name, value in entry.items()}
                               if isinstance(entry, dict) else self._state_value(entry))
        self.made[id(real_state)] = state
        return state

    def _hyperparameter(self, value: Any) -> Any:
        """A param group's setting as the fake optimizer reads it: a tensor as
        :meth:`_state_value` fakes it (its number kept), in a tuple or list too (``betas``)."""
        if isinstance(value, (tuple, list)) and any(isinstance(item, torch.Tensor) for item in value):
            items = [self._hyperparameter(item) for item in value]
            return items if isinstance(value, list) else tuple(items)
        return self._state_value(value) if isinstance(value, torch.Tensor) else value

    def _state_value(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        if value.dim() == 0:
            # a step counter that the optimizer reads with .item(): a fake tensor made from a
            # Python number keeps its value, one made from a real tensor does not
            return self.scalar(value)
        return self.fake(value)


def _default_foreach(params: list[torch.Tensor]) -> bool:
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])
    except Exception:  # noqa: BLE001 - a private helper; the loop is a fine default
        return False
