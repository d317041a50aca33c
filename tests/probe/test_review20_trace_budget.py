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


def test_review37_a_datasets_per_sample_reads_do_not_spend_the_trace_budget():
    """The command line's ``data.dataset`` batches (``DatasetBatches``) read one sample at a time: traced, those
    reads ran operators in proportion to the batch, so every dataset's probe lost its estimate, its note blaming
    "the step's operators" (a plain MLP under 256 KiB: 4 trials in 8.6 s, with it 3 in 3.4 s). The batch is
    built for real, as a data-dependent one is, and a vectorised step over it keeps its estimate."""
    from autobatch.workloads.batches import DatasetBatches

    class Samples(torch.utils.data.Dataset):  # a few operators per sample read, as a transform runs
        def __init__(self):
            self.x = torch.randn(64, 4)

        def __len__(self):
            return 64

        def __getitem__(self, i):
            return (self.x[i] * 2 - 1).relu(), i % 3

    model = torch.nn.Linear(4, 3)
    batches = DatasetBatches(Samples())
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), batches)
    line = estimate_line(step, 2**12, include_resident=False, sizes=(2, 16), op_growth=OP_GROWTH)
    assert line.batch_size == 78  # 52 B a sample (not stopped at batch 79, past 4 times batch 2's operators)
