"""Review 17: the estimate on models its authors did not try: sparse tensors (a graph network's
adjacency) and a TorchScript submodule."""

import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, estimate_memory, simulated_memory
from autobatch.probe.tracing.estimate import EstimateError

NODES = 64
_DRAWS = torch.Generator().manual_seed(0)
ADJACENCY = torch.sparse_coo_tensor(torch.randint(0, NODES, (2, 4 * NODES), generator=_DRAWS), torch.ones(4 * NODES),
                                    (NODES, NODES), check_invariants=False)
FEATURES = torch.randn(NODES, 8, generator=_DRAWS)


class Graph(torch.nn.Module):
    def __init__(self, gradient_through_adjacency: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.through = gradient_through_adjacency
        self.layer = torch.nn.Linear(8, 4)

    def forward(self, nodes: torch.Tensor) -> torch.Tensor:
        if self.through:  # a GCN: backward multiplies by the adjacency's transpose, a new sparse tensor
            return torch.sparse.mm(ADJACENCY.coalesce(), self.layer(FEATURES))[nodes]
        return self.layer(torch.sparse.mm(ADJACENCY, FEATURES)[nodes])  # dense result, no sparse gradient


def _step(model: torch.nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     lambda n: (torch.arange(n) % NODES, torch.arange(n) % 4))


def test_a_sparse_matrix_read_as_it_is_is_estimated_exactly():
    """A real sparse tensor the step read crashed the trace ("Cannot access storage of
    SparseTensorImpl"): now its index and value tensors count as resident, as a dense one's storage."""
    step = _step(Graph(gradient_through_adjacency=False))
    estimated = estimate_memory(step, 32).step_peak_bytes
    with simulated_memory("64MiB") as simulation:
        step(32)
        step(32)
    assert estimated == pytest.approx(simulation.peak_bytes, rel=0.001)


def test_a_sparse_result_is_refused_by_its_operator():
    """Fake sparse results have no nonzeros (coalesce, transpose): counted as nothing, they made a
    GCN's estimate 30 % high once the trace could run; the trace now says so instead."""
    with pytest.raises(EstimateError, match=r"aten\._coalesce\.default returns a sparse tensor.*depends on the data"):
        estimate_memory(_step(Graph(gradient_through_adjacency=True)), 8)


def test_a_torchscript_submodule_is_named():
    """Its parameters are new Python objects at each access, so the estimate said the optimizer
    trains a parameter the model does not hold."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.jit.script(torch.nn.Linear(8, 4)))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(),
                     lambda n: torch.randn(n, 8))
    with pytest.raises(EstimateError, match=r"submodule '0' is a TorchScript module.*before scripting it"):
        estimate_memory(step, 4)
