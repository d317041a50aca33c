"""A custom batch sampler (a bucketing one) drawing its order from a generator of its own under any
attribute name, ``self.rng = torch.Generator()``, ``random.Random(seed)`` or
``numpy.random.default_rng(seed)``: a run resumed in its second epoch replayed that epoch from the
sampler's fresh state, the first epoch's order, and trained some samples twice and others not at
all, without a word. The checkpoint held only ``DataLoader(generator=...)`` and a sampler's
``generator``; it now holds every generator the loader, its samplers and its dataset keep."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from autobatch import Runner

SAMPLES, GLOBAL = 20, 8  # 8, 8 and a short 4: three steps an epoch


class OwnOrder(Sampler):
    """Batches of a permutation drawn each epoch from the sampler's own generator, ``self.rng``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.rng = {"torch": lambda: torch.Generator().manual_seed(7), "python": lambda: random.Random(7),
                    "numpy": lambda: numpy.random.default_rng(7)}[kind]()

    def __iter__(self):
        if self.kind == "torch":
            order = torch.randperm(SAMPLES, generator=self.rng).tolist()
        elif self.kind == "python":
            order = self.rng.sample(range(SAMPLES), SAMPLES)
        else:
            order = self.rng.permutation(SAMPLES).tolist()
        for start in range(0, SAMPLES, GLOBAL):
            yield order[start : start + GLOBAL]

    def __len__(self) -> int:
        return -(-SAMPLES // GLOBAL)


def run(kind: str, steps: int, checkpoint_dir=None, resume=None) -> list[list[int]]:
    """The samples of each applied step of a run built afresh (a new process would build it so)."""
    data = TensorDataset(torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(0)), torch.arange(SAMPLES))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    seen: list[list[int]] = []

    def loss_fn(model, batch):
        seen.append(batch[1].tolist())
        return model(batch[0]).pow(2).mean()

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=GLOBAL, micro_batch=GLOBAL,
                    checkpoint_dir=checkpoint_dir, progress=False, log_every=None)
    runner.fit(DataLoader(data, batch_sampler=OwnOrder(kind)), epochs=2, steps=steps, resume=resume)
    return seen


@pytest.mark.parametrize("kind", ["torch", "python", "numpy"])
def test_a_resume_in_the_second_epoch_draws_a_custom_samplers_order(tmp_path, kind):
    whole = run(kind, steps=6)
    assert sorted(sum(whole[:3], [])) == sorted(sum(whole[3:], [])) == list(range(SAMPLES))
    assert whole[:3] != whole[3:]  # the second epoch has an order of its own
    run(kind, steps=4, checkpoint_dir=tmp_path)  # stopped in the second epoch's first step
    assert run(kind, steps=6, checkpoint_dir=tmp_path, resume=tmp_path) == whole[4:]
