"""Real tensors a fake-tensor trace writes in place, and their values put back after it.

Under ``FakeTensorMode`` an operator whose tensor inputs are all real runs for real: an in-place
one writes the real tensor. A trace swaps the model's parameters and buffers for fakes
(:class:`~autobatch.probe.tracing.fake_trace.FakeWorld`), but not what forward keeps elsewhere: a tensor
held as a plain module attribute (an EMA copy of the weights, ``self.ema.mul_(0.99)``; a step
counter, ``self.updates.add_(1)``), one in a helper object, a closure or a global. Each trace
wrote it again: ``strategy="estimate"`` (and ``estimate_memory``) left such an attribute 12
updates on, the counter at 12, where the model given was promised back unchanged.
:class:`RealWrites`, entered above the fake mode, copies each real tensor an operator is about to
write (once, in host memory, outside every mode) and writes those values back when it exits (the estimate's
traces, :mod:`.estimate`, and the cache key's fake batches, :mod:`.key_batches`).
The attributes themselves (which object each holds) are :mod:`.trace_state`'s business.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["RealWrites"]

#: per operator, the schema's arguments it writes (``self`` of ``add_``, ``out=``): (position, name)
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    if func not in _WRITTEN:
        schema = getattr(func, "_schema", None)
        _WRITTEN[func] = tuple((i, arg.name) for i, arg in enumerate(schema.arguments if schema is not None else ())
                               if arg.alias_info is not None and arg.alias_info.is_write)
    return _WRITTEN[func]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):  # Tensor[] arguments (the _foreach_ operators)
        yield from (item for item in value if isinstance(item, torch.Tensor))


def _real(tensor: torch.Tensor) -> bool:
    """A tensor holding data: not a fake (nor another subclass), not on the meta device."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and not tensor.is_meta


class RealWrites(TorchDispatchMode):
    """Enter it above a trace's fake mode: every real tensor an operator writes in place is copied
    first (host memory, no budget counts it), and the copies are written back on exit."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        for position, name in _written(func):
            value = args[position] if position < len(args) else kwargs.get(name)
            for tensor in _tensors(value):
                if id(tensor) not in self.saved and _real(tensor):
                    with _disable_current_modes(), torch.no_grad():
                        self.saved[id(tensor)] = (tensor, tensor.detach().to("cpu", copy=True))
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc_value, traceback):  # noqa: D105
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            self.put_back()

    def put_back(self) -> None:
        """Write the saved values back (outside every mode: an in-place copy allocates nothing; the
        shapes are the same, as the fake mode refuses a real tensor's ``resize_``)."""
        with _disable_current_modes(), torch.no_grad():
            for tensor, value in self.saved.values():
                with torch.inference_mode(tensor.is_inference()):
                    tensor.copy_(value)
        self.saved.clear()
