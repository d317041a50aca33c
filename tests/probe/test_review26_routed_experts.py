"""A top-k mixture-of-experts step under find_max_batch (review 26).

Each expert runs on the tokens routed to it (``nonzero`` on the routing: shapes that depend on the values),
so the step's memory depends on the batch's content. A top-2-of-4 MoE answered 217 under 600,000 simulated
bytes with no note, its trial's steps peaking within 1 % of each other, where another draw fits 216 and the
Runner replayed its first step at 217. The estimate's trace already stopped at that operator: now the probe
says the memory depends on the data."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import autobatch
from autobatch.probe.content_peaks import shapes_note

CAP = 60_000


class TopK(nn.Module):
    """Top-2 of 4 experts, each run on the rows routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(4))

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)  # as many rows as the routing sends
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out


def _step():
    torch.manual_seed(0)
    model = nn.Sequential(TopK(), nn.Linear(8, 3))
    return autobatch.TrainStep(model, torch.optim.Adam(model.parameters()), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 8), torch.randint(0, 3, (n,))))


def test_a_routed_mixture_of_experts_answer_says_its_memory_depends_on_the_data():
    result = autobatch.find_max_batch(_step(), memory_limit=CAP, cache=False)
    told = [note for note in result.notes if "depends on the batch's content" in note]
    assert result.batch_size > 8 and told, result.notes
    assert f"the answer, {result.batch_size}, holds for the batches the trials drew" in told[0]


def test_a_step_the_estimate_traced_or_stopped_for_another_reason_gets_no_shapes_note():
    assert shapes_note("first trial placed by an estimate (estimated boundary 12; 2 fake-tensor traces, 0.1 s)", 12) is None
    assert shapes_note("no estimate for the first trial (could not trace the step with fake tensors: "
                       "DataDependentOutputException: aten._local_scalar_dense.default ...); probed from the start", 12) is None
    assert shapes_note(None, 12) is None
