"""A module the step reaches but ``restore`` does not hold, changed by the trials, told.

A step that updates an EMA teacher (DINO, BYOL, MoCo: ``teacher_param.lerp_(student_param, 1 - m)``
after the optimizer's step), or runs a frozen module in train mode (its BatchNorm statistics), writes
a module no optimizer steps. Given ``restore=(student, optimizer)``, the probe put back the student
and its optimizer, and the teacher kept a dozen or more of the trials' updates on random batches,
with no word (an MLP's teacher ended its weights moved by the trials, bit-different from before the
probe). The probe cannot copy every module the step reaches (a large frozen one would cost host memory
and seconds for nothing), so it reads the version counters of their parameters and buffers before
the trials and after the restore (no copy, no device sync), and where one changed a ``RuntimeWarning``
names it and says to pass its module in ``restore``, which puts it back. Parameters an optimizer stepped
are left to :func:`~autobatch.probe.snapshot.unrestored.warn_unrestored_optimizers`, which names that
optimizer.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from ...memory.lazy_state import hooked
from ..tracing.trace_state import _reachable, code_globals

__all__ = ["OutsideWrites"]

MAX_TENSORS = 4096  # version counters read, at most (a host read each, twice a probe)


class OutsideWrites:
    """The parameters and buffers of the modules ``fn`` reaches outside ``restore``, with their versions."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = tensors
        self.versions = [tensor._version for _, tensor in tensors]

    @classmethod
    def of(cls, fn: Any, restore: tuple[Any, ...] | None) -> "OutsideWrites":
        """Those of the modules reached from ``fn`` (its closure, the objects it holds, the globals its code
        reads; a ``TrainStep``'s ``loss_fn`` through it) that are not in a module of ``restore``."""
        if restore is None:  # a plain callable without restore trains for real, as documented (and noted)
            return cls([])
        given = [item for item in restore if isinstance(item, torch.nn.Module)]
        own = {id(t) for module in given for t in (*module.parameters(), *module.buffers())}
        own |= {id(p) for item in restore if isinstance(hooked(item), torch.optim.Optimizer)
                for group in hooked(item).param_groups for p in group["params"]}
        read: list[tuple[Any, str, Any]] = []
        roots = [fn, *code_globals([fn], bindings=read).values(),
                 *(value for _, _, value in read if isinstance(value, torch.nn.Module))]
        leaf = lambda value: isinstance(value, torch.nn.Module)  # noqa: E731 - not looked into: its tensors are read
        tensors: dict[int, tuple[str, torch.Tensor]] = {}
        for module in _reachable(roots, leaf=leaf):
            if not isinstance(module, torch.nn.Module) or any(module is item for item in given):
                continue
            for name, tensor in (*module.named_parameters(), *module.named_buffers()):
                if id(tensor) not in own and not _fake(tensor) and len(tensors) < MAX_TENSORS:
                    tensors.setdefault(id(tensor), (f"{type(module).__name__}'s {name}", tensor))
        return cls(list(tensors.values()))

    def warn(self, stepped: Iterable[torch.optim.Optimizer]) -> None:
        """Warn where the trials changed one, in place, outside every optimizer's step."""
        trained = {id(p) for optimizer in stepped for group in getattr(hooked(optimizer), "param_groups", ())
                   for p in group["params"]}
        written = [name for (name, tensor), version in zip(self.tensors, self.versions)
                   if tensor._version != version and id(tensor) not in trained]
        if written:
            more = f" (and {len(written) - 1} more)" if len(written) > 1 else ""
            warnings.warn(
                f"the probe's trials changed {written[0]}{more}, a module the step reaches that restore does not hold "
                "(an EMA teacher updated each step, a frozen module's BatchNorm statistics), so it keeps their changes; "
                "pass that module in restore=(model, optimizer, other_module) to have it put back",
                RuntimeWarning, stacklevel=4,
            )


def _fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)
