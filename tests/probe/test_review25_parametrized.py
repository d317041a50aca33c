"""Parametrized weights under find_max_batch (review 25): spectral norm's forward writes its
power-iteration vectors on every trial step, weight norm recomputes its weight. The answer is
the exact largest size that trains three steps under the same cap, and the vectors, the weights
and the optimizer are put back bit for bit, so training after the probe starts where it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

import autobatch
from autobatch.memory.simulated import simulated_memory

NORMS = {"spectral_norm": parametrizations.spectral_norm, "spectral_norm_hook": torch.nn.utils.spectral_norm,
         "weight_norm": parametrizations.weight_norm}
CAP = 40_000


def _step(norm):
    torch.manual_seed(0)
    model = nn.Sequential(norm(nn.Linear(16, 64)), nn.ReLU(), norm(nn.Linear(64, 4)))
    return autobatch.TrainStep(model, torch.optim.Adam(model.parameters()), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))


def _trains(norm, size):
    step = _step(norm)
    try:
        with simulated_memory(CAP):
            for _ in range(3):
                step(size)
    except torch.OutOfMemoryError:
        return False
    return True


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.spectral_norm: the older form
def test_a_parametrized_model_gets_the_exact_largest_and_its_state_back(name):
    step = _step(NORMS[name])
    before = {key: value.clone() for key, value in step.model.state_dict().items()}
    answer = autobatch.find_max_batch(step, memory_limit=CAP, cache=False, estimate_first=False).batch_size
    assert _trains(NORMS[name], answer) and not _trains(NORMS[name], answer + 1)
    after = step.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
    assert not step.optimizer.state
