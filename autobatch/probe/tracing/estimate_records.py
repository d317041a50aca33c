"""The estimate's records: one traced batch size (:class:`MemoryEstimate`), the estimated largest
batch (:class:`BatchEstimate`), and the error of a step fake tensors cannot trace
(:class:`EstimateError`). :mod:`autobatch.probe.tracing.estimate` makes them and names them too."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...memory.units import format_bytes

__all__ = ["EstimateError", "MemoryEstimate", "BatchEstimate"]


class EstimateError(RuntimeError):
    """The step could not be traced with fake tensors (an unsupported operator, a
    data-dependent ``.item()``, a step that is not a :class:`~autobatch.TrainStep`). Not for an
    error of the step's own code, which is raised as itself."""


@dataclass
class MemoryEstimate:
    """Estimated memory of training steps at one batch size.

    ``resident_bytes``: parameters, buffers and optimizer state that exist before the step.
    ``step_peak_bytes``: the most memory allocated on top of them at any moment of the traced
    steps (activations, gradients, optimizer state created by the first step, temporaries).
    ``workspace_bytes``: cuBLAS workspaces the step's matrix products hold on CUDA
    (:mod:`autobatch.memory.workspaces`), allocated by the step and kept by the process.
    """

    batch_size: int
    resident_bytes: int
    step_peak_bytes: int
    device: str
    workspace_bytes: int = 0
    operations: int = 0  # operators the trace ran (:mod:`~autobatch.probe.tracing.trace_budget`)
    held_growth_bytes: int = 0  # what each step still added to memory held after the last traced (a leak)

    @property
    def peak_bytes(self) -> int:
        """Resident, step peak and workspaces: what ``torch.cuda.max_memory_allocated`` would report."""
        return self.resident_bytes + self.step_peak_bytes + self.workspace_bytes

    def counted(self, include_resident: bool) -> int:
        """The peak counted against a capacity: all of it, or without the resident bytes."""
        return self.peak_bytes if include_resident else self.step_peak_bytes + self.workspace_bytes


@dataclass
class BatchEstimate:
    """The largest batch whose *estimated* peak fits ``capacity_bytes``; never run.

    ``batch_size`` is 0 when not even the smallest batch fits. ``include_resident`` says
    whether the model's resident memory was counted against the capacity. ``estimates`` are
    the traced sizes; ``intercept_bytes``/``slope_bytes_per_sample`` the local line through
    the two traced sizes nearest the answer.
    """

    batch_size: int
    capacity_bytes: int
    peak_bytes: int | None
    include_resident: bool
    intercept_bytes: float
    slope_bytes_per_sample: float
    device: str
    estimates: list[MemoryEstimate] = field(default_factory=list)

    def __repr__(self) -> str:
        """One line, as :class:`~autobatch.probe.result.ProbeResult`'s: the answer and what it was
        measured against (the traces are in :meth:`to_dict`; listed, they made a kilobyte)."""
        peak = "none fits" if self.peak_bytes is None else format_bytes(self.peak_bytes)
        return (f"BatchEstimate(batch_size={self.batch_size}, peak={peak} of {format_bytes(self.capacity_bytes)}, "
                f"{format_bytes(self.slope_bytes_per_sample)}/sample, include_resident={self.include_resident}, "
                f"{len(self.estimates)} traces, device={self.device!r})")

    @property
    def held_growth_note(self) -> str | None:
        """Where the step at the answer keeps more memory after every traced step (a leak, which a
        probe's trial notes too: :mod:`autobatch.probe.held_growth`), what that means; else None. The
        answer holds for the steps traced only: training runs out of memory some steps later."""
        growth = next((e.held_growth_bytes for e in self.estimates if e.batch_size == self.batch_size), 0)
        if not growth:
            return None
        return (f"memory held between steps grew by {format_bytes(growth)} in each traced step at batch "
                f"{self.batch_size}, through the last: the step keeps tensors alive from call to call (outputs or "
                "losses appended to a list, a hook that keeps activations, a cache that grows), so training at "
                f"{self.batch_size} runs out of memory some steps later. Keep only what you need (loss.item(), "
                "out.detach().cpu()), or clear it, and estimate again.")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["estimates"] = [[e.batch_size, e.resident_bytes, e.step_peak_bytes, e.workspace_bytes] for e in self.estimates]
        return data
