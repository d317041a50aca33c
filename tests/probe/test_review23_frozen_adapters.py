"""Parameter-efficient fine-tuning: a frozen backbone with LoRA-style low-rank adapters, the
optimizer over the adapters only. The probe's answer is the exact largest size that trains three
steps under the same cap, and a step whose adapters sit inside the user's reentrant checkpoint
after a frozen embedding (no input requires grad: torch gives them no gradient) is told so; the
message named only a cut graph or a frozen model, though the optimizer trained twelve adapters."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autobatch
from autobatch.memory.simulated import simulated_memory


class _LoRA(nn.Module):
    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.down, self.up = nn.Linear(base.in_features, rank, bias=False), nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = _LoRA(nn.Linear(d, 4 * d)), _LoRA(nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Model(nn.Module):
    def __init__(self, reentrant=None, d=8):
        super().__init__()
        self.reentrant = reentrant
        self.emb, self.head = nn.Embedding(20, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(2)])

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h).mean(1)


def _step(reentrant=None, head=False):
    torch.manual_seed(0)
    model = _Model(reentrant)
    model.requires_grad_(False)
    model.head.requires_grad_(head)
    for module in model.modules():
        if isinstance(module, _LoRA):
            module.down.requires_grad_(True)
            module.up.requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return autobatch.TrainStep(model, optimizer, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randint(0, 20, (n, 8)), torch.randint(0, 3, (n,))))


def _trains(size, cap):
    step = _step()
    try:
        with simulated_memory(cap):
            for _ in range(3):
                step(size)
    except torch.OutOfMemoryError:
        return False
    return True


def test_the_answer_for_frozen_backbone_adapters_is_the_exact_largest():
    cap = 12_000
    answer = autobatch.find_max_batch(_step(), memory_limit=cap, cache=False, strategy="binary").batch_size
    assert _trains(answer, cap) and not _trains(answer + 1, cap)


def test_adapters_cut_off_by_a_reentrant_checkpoint_are_named():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own "None of the inputs have requires_grad=True"
        with pytest.raises(ValueError, match="use_reentrant=False") as caught:
            autobatch.find_max_batch(_step(reentrant=True), memory_limit=40_000, cache=False, strategy="binary")
    assert "does not require grad" in str(caught.value)
    assert autobatch.find_max_batch(_step(reentrant=False), memory_limit=40_000, cache=False, max_batch=4,
                                  strategy="binary").batch_size == 4


def test_adapters_a_trainable_head_hides_are_noted():
    """With a trainable head the loss requires grad, so nothing raised: the trials trained the head
    alone, and the answer held no optimizer state for the adapters, without a word."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        step = _step(reentrant=True, head=True)
        cut = autobatch.find_max_batch(step, memory_limit=40_000, cache=False, max_batch=4, strategy="binary")
    adapters = sum(p.requires_grad for p in step.model.blocks.parameters())
    trained = sum(p.requires_grad for p in step.model.parameters())
    assert any(f"{adapters} of the {trained} parameters the optimizer trains got no gradient" in note for note in cut.notes)
    whole = autobatch.find_max_batch(_step(reentrant=False, head=True), memory_limit=40_000, cache=False,
                                     max_batch=4, strategy="binary")
    assert not any("got no gradient" in note for note in whole.notes)
