"""What ``auto``'s estimate may cost: its traces stop where the step's operators grow with the batch.

A fake-tensor trace costs per operator, not per byte (each one dispatches through the fake mode
and the accountant), so a step whose operators do not depend on the batch (a vectorised model)
traces 256 samples about as fast as 16, and ``auto``'s first trial is cheaply placed. A step that
loops over its samples (a per-sample list of tensors, ``torch.stack([f(x) for x in batch])``) runs
operators in proportion to its batch, each traced about ten times slower than it runs: there the
traces at 16, 256 and the predicted boundary cost more than the trials they spare (a per-sample
model under a 2 MiB simulated budget: 15.3 s of traces, where ``predict``'s trials took 2.9 s in
all). So ``auto``'s traces after its first run at most :data:`OP_GROWTH` times the first's
operators; past that the trace stops, and the probe runs its trials from the start with a note
saying why (:class:`OperationBudget`). ``strategy="estimate"``, asked for by name, traces on.
"""

from __future__ import annotations

__all__ = ["OperationBudget", "OP_GROWTH"]

#: A trace after the first may run this many times the first trace's operators (16 samples to
#: 256: a vectorised step runs the same operators, a loop over samples 16 times as many; a step
#: chunking its batch by 64 runs at most 4 times as many, and keeps its estimate)
OP_GROWTH = 4


class OperationBudget:
    """The operator limit of each trace after the first (None: no limit, or no trace yet)."""

    def __init__(self, growth: float | None) -> None:
        self.growth = growth
        self.first: tuple[int, int] | None = None  # (batch size, operators) of the first trace

    def limit(self) -> int | None:
        """The most operators the next trace may run."""
        if self.growth is None or self.first is None:
            return None
        return int(self.growth * max(self.first[1], 1))

    def record(self, batch_size: int, operations: int) -> None:
        """Keep the first trace's operator count."""
        if self.first is None:
            self.first = (batch_size, operations)

    def refusal(self, batch_size: int) -> str:
        """Why the trace at ``batch_size`` stopped."""
        assert self.first is not None
        return (f"the step's operators grow with its batch (a loop over its samples?): tracing batch {batch_size} "
                f"passed {self.limit()} operators, {self.growth:g} times the {self.first[1]} of batch "
                f"{self.first[0]}'s trace, so each trace costs more than the trial it would spare")
