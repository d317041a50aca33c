"""A scheduler built on another optimizer than the runner's (an optimizer made again in a notebook
cell, the scheduler left on the old one) is one ``ValueError`` when the ``Runner`` is built: before,
the runner stepped it after every update, it changed the old optimizer's learning rate, and the run
trained at a constant rate with only torch's "lr_scheduler.step() before optimizer.step()" warning."""

import pytest
import torch

import autobatch


def _loss(model, batch):
    return model(batch[0]).pow(2).mean()


def test_scheduler_of_another_optimizer_is_refused():
    model = torch.nn.Linear(4, 2)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(stale, 1, 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # made again; the scheduler still steps `stale`
    with pytest.raises(ValueError, match="scheduler steps another optimizer"):
        autobatch.Runner(model, optimizer, _loss, global_batch=4, scheduler=scheduler, progress=False)


def test_scheduler_of_the_runners_optimizer_trains_its_schedule():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    runner = autobatch.Runner(model, optimizer, _loss, global_batch=4, scheduler=scheduler, progress=False)
    runner.fit([(torch.randn(4, 4),)] * 2, steps=2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
