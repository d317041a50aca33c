"""A model whose blocks a plan already checkpoints (``plan.apply(model)``), trained by a ``Runner``
that still runs out of memory at micro-batch 1: the error said "without activation checkpointing"
and advised ``checkpointing_fallback=True``, which then found no block left to wrap."""

import pytest
import torch
from torch import nn

import autobatch
from autobatch.planning.checkpointing import enable_checkpointing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def forward(self, x):
        return x + self.inner(x)


@pytest.mark.parametrize("fallback", [False, True])
def test_an_oom_at_micro_batch_1_of_a_checkpointed_model_says_it_was_checkpointed(fallback):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    assert enable_checkpointing(model).modules  # as plan.apply(model) does
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = autobatch.Runner(model, optimizer, lambda m, b: m(b).pow(2).mean(), global_batch=4, micro_batch=4,
                              checkpointing_fallback=fallback, progress=False)
    with autobatch.simulated_memory("300KiB"), pytest.raises(autobatch.errors.StepOutOfMemoryError) as caught:
        runner.fit([torch.randn(4, 64)])
    message = str(caught.value)
    assert caught.value.checkpointing and "with activation checkpointing" in message
    assert "checkpointing_fallback=True" not in message and "wrapped no block" not in message
