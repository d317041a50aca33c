"""plan() on a WGAN-GP critic step (review 26): a gradient penalty (``torch.autograd.grad(...,
create_graph=True)``, double backward) through checkpointed blocks recomputes them inside the
penalty's graph, and so takes more memory than the plain step. With accumulation not allowed,
``GlobalBatchTooLargeError`` named the checkpointed answer as "the largest batch that trains" (70
under 400,000 simulated bytes, where 74 trains plainly), as if checkpointing had helped; now the plain answer, and that checkpointing could not help."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import GlobalBatchTooLargeError, TrainStep, plan

CAP = 90_000


def critic_loss(model, batch):
    """Wasserstein critic loss with a gradient penalty on interpolates (WGAN-GP)."""
    real, fake = batch
    eps = torch.rand(len(real), 1)
    mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(model(mixed).sum(), mixed, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return model(fake).mean() - model(real).mean() + 10 * penalty


def _step():
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(32, 32), nn.Tanh())  # noqa: E731 - two repeated blocks to checkpoint
    model = nn.Sequential(nn.Linear(8, 32), block(), block(), nn.Linear(32, 1))
    return TrainStep(model, torch.optim.Adam(model.parameters()), critic_loss, lambda n: (torch.randn(n, 8), torch.randn(n, 8)))


def test_a_global_batch_too_large_names_the_plain_answer_where_checkpointing_costs_memory():
    with pytest.raises(GlobalBatchTooLargeError) as caught:
        plan(_step(), global_batch=128, allow_accumulation=False, memory_limit=CAP, cache=False, steps_per_trial=1,
             strategy="binary", start=16)
    error = caught.value
    assert not error.checkpointing, str(error)
    assert "without activation checkpointing" in str(error) and "could not help: with it, the largest is" in str(error)
    checkpointed = int(str(error).rsplit("the largest is ", 1)[1].rstrip("."))
    assert checkpointed < error.largest_fit  # the plain step's answer, which checkpointing did not raise
