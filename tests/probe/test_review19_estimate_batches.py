"""Review 19: the estimate on batches its authors did not try: a variable-size batch of graphs
whose ``make_batch`` reads the graphs' sizes (refused before; now built for real and counted), and
a jagged nested tensor (its fake-tensor limit was reported as the step's own ``AssertionError``)."""

import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, estimate_memory, simulated_memory
from autobatch.probe.tracing.estimate import EstimateError

_DRAWS = torch.Generator().manual_seed(0)
SIZES = torch.randint(3, 12, (256,), generator=_DRAWS)  # nodes per graph
FEATURES = torch.randn(int(SIZES.sum()), 8, generator=_DRAWS)  # a preloaded dataset: resident, not allocated


class MessagePassing(torch.nn.Module):
    """Sums messages into nodes with ``index_add_`` and pools each graph with ``scatter_reduce``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.message, self.update, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3)

    def forward(self, x, src, dst, graph, graphs):
        summed = torch.zeros_like(x).index_add_(0, dst, self.message(x)[src])
        h = F.relu(self.update(torch.cat([x, summed], 1)))
        pooled = torch.zeros(graphs, 8).scatter_reduce(0, graph[:, None].expand_as(h), h, "mean", include_self=False)
        return self.head(pooled)


def _graphs(n: int):
    """``n`` graphs in one batch, as a graph library collates them: the sizes' values shape it."""
    sizes = SIZES[:n]
    nodes = int(sizes.sum())  # a value read: refused under fake tensors
    offsets = (torch.cumsum(sizes, 0) - sizes).repeat_interleave(2 * sizes)  # shaped by the values
    per = sizes.repeat_interleave(2 * sizes)
    src = torch.randint(0, 1 << 20, (per.numel(),)) % per + offsets
    dst = torch.randint(0, 1 << 20, (per.numel(),)) % per + offsets
    return FEATURES[:nodes], src, dst, torch.repeat_interleave(torch.arange(n), sizes), n, torch.randint(0, 3, (n,))


def _step() -> TrainStep:
    model = MessagePassing()
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, b: F.cross_entropy(m(*b[:5]), b[5]), _graphs)


def test_a_batch_built_from_its_datas_values_is_built_for_real_and_counted():
    """Refused before ("aten._local_scalar_dense ... in make_batch"): the batch is now built for
    real outside the fake mode and counted as the step allocates it; the preloaded features it
    slices are resident, as in a trial, and torch's random generator is put back."""
    step, before = _step(), torch.get_rng_state()
    estimate = estimate_memory(step, 16)
    assert torch.equal(torch.get_rng_state(), before)
    assert estimate.resident_bytes >= FEATURES.untyped_storage().nbytes()
    with simulated_memory("64MiB") as simulation:
        step(16)
        step(16)
    assert estimate.step_peak_bytes == pytest.approx(simulation.peak_bytes, rel=0.001)


def test_a_jagged_nested_tensor_is_the_traces_limit_not_the_steps_error():
    """PyTorch's fake tensors assert on a jagged tensor's ragged size; that ``AssertionError`` came
    out as the step's own error ("raised by the training step"), though the step runs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)

    def make_batch(n):
        return torch.nested.nested_tensor([torch.randn(i % 3 + 1, 4) for i in range(n)], layout=torch.jagged)

    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).values().square().mean(),
                     make_batch)
    with pytest.raises(EstimateError, match=r"jagged nested tensor.*pad_sequence.*strategy='binary'"):
        estimate_memory(step, 4)
