"""A buffer forward replaces (``self.count = self.count + 1``, an EMA of the inputs written as
``self.mean = 0.9 * self.mean + ...``) is put back before an OOM replay, as one updated in place
is. The guard told buffers apart by ``id()``: the replaced tensor was freed, a new one took its
address with the same version (0), and the failed attempt's update was neither copied nor undone:
the replay counted those samples twice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import FaultInjector, Runner

GLOBAL = 8


class InputAverage(nn.Module):
    """A linear model that keeps an EMA of its inputs and a count of forward calls, both replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        self.calls = self.calls + 1
        return self.linear(x)


def run(fault: tuple[int, str] | None) -> InputAverage:
    torch.manual_seed(0)
    model = InputAverage()
    data = [(torch.randn(GLOBAL, 4),) for _ in range(3)]
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b[0]).pow(2).mean(),
                    global_batch=GLOBAL, micro_batch=4, grow_after=None, progress=False,
                    faults=FaultInjector([fault], times=1) if fault else None)
    runner.fit(data)
    assert len(runner.result.oom_recoveries) == (1 if fault else 0)
    return model


@pytest.mark.parametrize("step", [0, 1, 2])
def test_a_replay_puts_back_a_buffer_forward_replaced(step):
    # an OOM after every forward of the step (optimizer), replayed at the same micro-batch, against no OOM
    reference, replayed = run(None), run((step, "optimizer"))
    assert int(replayed.calls) == int(reference.calls)
    torch.testing.assert_close(replayed.mean, reference.mean)
