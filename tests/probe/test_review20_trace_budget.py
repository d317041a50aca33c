"""Review 20: ``auto``'s estimate on a step that loops over its samples.

A fake-tensor trace costs per operator. A step running one forward per sample (a per-sample
list, ``torch.stack([f(x) for x in batch])``) runs operators in proportion to its batch, so
``auto``'s traces at 16, 256 and the boundary cost far more than the trials they spare (a
per-sample model under 2 MiB: 17.4 s of probe, 15.3 s of it traces, where ``predict`` took 2.9 s).
A trace after the first stops past ``OP_GROWTH`` times its operators (``auto`` then runs its
trials from the start, its note saying why); a vectorised step's traces run the same operators.
"""

import pytest
import torch

import autobatch
from autobatch.probe.tracing.estimate import EstimateError, estimate_line
from autobatch.probe.tracing.trace_budget import OP_GROWTH


class PerSample(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, batch):
        return torch.stack([row * self.weight for row in batch])  # one forward per sample


def _line(model):
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 4))
    return estimate_line(step, 2**20, include_resident=False, sizes=(2, 16), op_growth=OP_GROWTH)


def test_a_trace_whose_operators_grow_with_the_batch_stops():
    with pytest.raises(EstimateError, match=r"operators grow with its batch.*tracing batch \d+ passed \d+ operators"):
        _line(PerSample())  # (a vectorised step keeps its estimate: tests/probe/test_review11_estimate_flat.py)
