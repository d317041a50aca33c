"""Review 11: a resume with ``DataLoader(persistent_workers=True)`` trains the uninterrupted run's order.

A persistent loader makes its iterator once, in the first epoch (the workers' base seed drawn
from its generator, then the shuffle), and only resets it later (the shuffle alone). A resumed
process's new loader made its iterator afresh at a later epoch, drew the base seed first and
shuffled another order: the resumed epoch trained some samples twice and others never.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autobatch import Runner


def _run(seen: list[int], directory, **fit):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1), torch.arange(32))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=1,
                        persistent_workers=True)

    def loss_fn(model, batch):
        seen.extend(batch[2].tolist())
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    runner = Runner(model, optimizer, loss_fn, global_batch=8, micro_batch=8, progress=False,
                    checkpoint_dir=directory, checkpoint_every=fit.pop("every", None))
    runner.fit(loader, **fit)
    if loader._iterator is not None:  # its workers now, not at a later test's garbage collection (5 s a loader)
        loader._iterator._shutdown_workers()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stop", [6, 4], ids=["mid-epoch", "epoch-end"])
def test_persistent_workers_resume_in_the_uninterrupted_order(tmp_path, stop):
    reference: list[int] = []
    expected = _run(reference, None, epochs=3)
    seen: list[int] = []
    _run(seen, tmp_path, steps=stop, every=stop)  # a new loader below, as in a new process
    weights = _run(seen, tmp_path, epochs=3, resume=tmp_path)
    assert seen == reference
    for epoch in range(3):  # every sample once an epoch
        assert sorted(seen[epoch * 32:(epoch + 1) * 32]) == list(range(32))
    for mine, theirs in zip(weights, expected, strict=True):
        assert torch.equal(mine, theirs)
