"""Blocks one per inner list: ``layers = ModuleList([ModuleList([Attention(), FeedForward()]) for _ in range(depth)])``.

That is vit-pytorch's (and many a hand-written transformer's) layout. The automatic rule counted each block class
per inner list, found none repeated, and wrapped nothing: ``plan()`` raised ``NoBatchFitsError`` ("no nn.Sequential,
ModuleList or ModuleDict holds repeated blocks") where checkpointing the ``depth`` blocks of each class fits. An inner
``ModuleList`` is never called, so its entries now count with the outer list's.
"""

from __future__ import annotations

import torch
from torch import nn

from autobatch import TrainStep, plan
from autobatch.planning.checkpointing import find_blocks

WIDTH, TOKENS = 8, 64


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        return self.net(x)


class Transformer(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([Attention(), FeedForward()]) for _ in range(depth)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.head(x).pow(2).mean()


def test_review31_blocks_one_per_inner_list_are_found_and_planned():
    torch.manual_seed(0)
    model = Transformer()
    names = [f"layers.{i}.{j}" for i in range(3) for j in range(2)]
    assert find_blocks(model) == names
    plain = Transformer()
    plain.load_state_dict(model.state_dict())
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x), lambda n: torch.randn(n, TOKENS, WIDTH))
    planned = plan(step, global_batch=4, memory_limit="150KiB", steps_per_trial=1, strategy="binary")
    assert planned.checkpointing and planned.checkpointed_modules == names  # it raised NoBatchFitsError
    batch = torch.randn(4, TOKENS, WIDTH)
    for piece in planned.split(batch):
        (model(piece) * len(piece) / len(batch)).backward()
    plain(batch).backward()
    for (name, wrapped), unwrapped in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(wrapped.grad, unwrapped.grad, msg=name)
    planned.undo()
