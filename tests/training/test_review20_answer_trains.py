"""The probe's answer trains in the ``Runner`` under the same simulated budget, with no recovery
(issue 16's CPU line), for a small model at a large batch: the simulated device measures the
answer to the byte (its trial's peak was the budget itself), and the runner's step held a few
bytes more than the trial's, a second loss tensor (``loss * 1.0`` for one piece) through backward
and the last step's loss into the next, so its second step ran out of memory at the answer and
recovered at 0.92 of it (found by the CLI round: ``train`` with a user's MLP and AdamW)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autobatch
from autobatch.memory.simulated import host_memory


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


@pytest.fixture(scope="module")
def probed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    step = autobatch.TrainStep(model, optimizer, loss_fn, lambda n: (torch.randn(n, 16), torch.randint(0, 10, (n,))))
    found = autobatch.find_max_batch(step, memory_limit="1MiB", cache=False)
    return model, optimizer, found.batch_size


@pytest.mark.parametrize("pieces", [1, 2])
def test_the_answer_trains_in_the_runner_under_the_same_budget(probed, pieces):
    model, optimizer, answer = probed
    with autobatch.simulated_memory("1MiB"):
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=pieces * answer, micro_batch=answer, progress=False)
        with host_memory():
            data = [(torch.randn(pieces * answer, 16), torch.randint(0, 10, (pieces * answer,))) for _ in range(3)]
        result = runner.fit(data, epochs=1)
    assert result.steps == 3 and result.oom_recoveries == []
