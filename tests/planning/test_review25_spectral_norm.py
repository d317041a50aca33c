"""Spectral norm under plan() (review 25): its forward, in training mode, runs a power iteration
that updates the ``_u`` / ``_v`` buffers. A block the planner checkpointed ran it again in the
recompute, from the vectors the forward had just moved, so backward differentiated another
weight (gradients 1e-5 off the plain block's) and every micro-batch ran two iterations; a plan
that split such a model into micro-batches passed for exact although each trains another
normalised weight (0.3 % off one batch's gradient on a tiny MLP). Now the recompute replays the
forward's iteration and the split is noted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from autobatch import TrainStep, plan
from autobatch.planning.batch_statistics import POWER_ITERATION
from autobatch.planning.checkpointing import enable_checkpointing

NORMS = {"parametrization": parametrizations.spectral_norm, "hook": torch.nn.utils.spectral_norm}


class Block(nn.Module):
    def __init__(self, norm) -> None:
        super().__init__()
        self.fc = norm(nn.Linear(16, 16))

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def _model(norm):
    torch.manual_seed(0)
    return nn.Sequential(Block(norm), Block(norm), nn.Linear(16, 4))


@pytest.mark.parametrize("form", NORMS)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.spectral_norm: the older form
def test_a_checkpointed_spectral_norm_block_trains_the_plain_blocks_gradient(form):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    trained = []
    for wrap in (False, True):
        model = _model(NORMS[form])
        if wrap:
            assert len(enable_checkpointing(model)) == 2
        F.cross_entropy(model(x), y).backward()
        trained.append(([p.grad for p in model.parameters()], list(model.buffers())))
    for plain, wrapped in zip(*(grads for grads, _ in trained)):
        torch.testing.assert_close(wrapped, plain, rtol=0, atol=1e-9)
    for plain, wrapped in zip(*(buffers for _, buffers in trained)):
        assert torch.equal(wrapped, plain)  # one power iteration per forward, as without the checkpoint


@pytest.mark.parametrize("spectral", [True, False], ids=["spectral_norm", "weight_norm"])
def test_a_plan_that_splits_a_spectral_norm_model_says_so(spectral):
    torch.manual_seed(0)
    norm = parametrizations.spectral_norm if spectral else parametrizations.weight_norm
    model = nn.Sequential(norm(nn.Linear(16, 64)), nn.ReLU(), norm(nn.Linear(64, 4)))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))
    result = plan(step, global_batch=400, memory_limit="64KiB", steps_per_trial=1, strategy="binary", cache=False,
                  allow_checkpointing=False, estimate_first=False)
    assert result.accumulation_steps > 1
    found = [note for note in result.notes if note.startswith(POWER_ITERATION)]
    assert bool(found) is spectral
    if spectral:
        assert "0: Linear, 2: Linear" in found[0] and f"{result.accumulation_steps} micro-batches" in found[0]
