"""A model whose forward checkpoints its own blocks with ``torch.utils.checkpoint`` (no Transformers flag)
got them wrapped again by the planner: a recompute nested in the model's, the same peak, and an error
saying "This is with activation checkpointing of 4 blocks" as if checkpointing had been tried and failed."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autobatch
from autobatch.planning.checkpointing import is_checkpointed


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class _SelfCheckpointed(nn.Module):
    def __init__(self, reentrant, d=8, n=3):
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.out = nn.Linear(4, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(n)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.out(x).mean(1)


def _step(model):
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 32, 4), torch.randint(0, 3, (n,))))


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocks_the_model_checkpoints_itself_are_not_wrapped_again(reentrant):
    torch.manual_seed(0)
    model = _SelfCheckpointed(reentrant)
    with pytest.raises(autobatch.NoBatchFitsError) as caught:
        autobatch.plan(_step(model), global_batch=4, memory_limit=6_000, cache=False, steps_per_trial=1,
                       strategy="binary")
    message = str(caught.value)
    assert "its code recomputes" in message and "torch.utils.checkpoint" in message
    assert "This is with activation checkpointing" not in message
    assert not any(probe["checkpointing"] for probe in caught.value.attempts)  # no nested recompute was probed
    assert not any(is_checkpointed(block) for block in model.blocks)
