"""A notebook user's plain callable steps an LR scheduler they did not pass in ``restore``: the
probe put the optimizer's learning rate back but left the scheduler the trials' steps ahead, so
the next ``scheduler.step()`` jumped (review 26). The scheduler the callable reaches is put back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autobatch


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):  # trained for a while: Adam's moments, the scheduler three steps in
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    def step(batch_size: int) -> None:  # the scheduler reached through the closure, not restore
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(batch_size, 8)), torch.randint(0, 2, (batch_size,))).backward()
        optimizer.step()
        scheduler.step()

    return step


def test_a_scheduler_the_callable_steps_is_put_back_with_the_optimizer():
    model, optimizer, scheduler = _trained()
    before, lrs = scheduler.state_dict(), [group["lr"] for group in optimizer.param_groups]
    result = autobatch.find_max_batch(_step(model, optimizer, scheduler), memory_limit="1MiB", cache=False,
                                      restore=(model, optimizer))
    assert scheduler.state_dict() == before  # last_epoch was 3 + every trial's steps
    assert [group["lr"] for group in optimizer.param_groups] == lrs
    assert any("StepLR" in note and "restore" in note for note in result.notes)


def test_the_result_of_a_plain_callable_says_what_restore_cannot_know():
    model, optimizer, scheduler = _trained()
    result = autobatch.find_max_batch(_step(model, optimizer, scheduler), memory_limit="1MiB", cache=False,
                                      restore=(model, optimizer, scheduler))
    assert any("the callable keeps itself" in note for note in result.notes)


_GLOBAL = {}


def _notebook_step(batch_size: int) -> None:  # a notebook cell's function: the scheduler is a global
    _GLOBAL["optimizer"].zero_grad()
    F.cross_entropy(_GLOBAL["model"](torch.randn(batch_size, 8)), torch.randint(0, 2, (batch_size,))).backward()
    _GLOBAL["optimizer"].step()
    SCHEDULER.step()


def test_a_scheduler_the_callable_reads_as_a_global_is_put_back():
    global SCHEDULER
    model, optimizer, SCHEDULER = _trained()
    _GLOBAL.update(model=model, optimizer=optimizer)
    before = SCHEDULER.state_dict()
    autobatch.find_max_batch(_notebook_step, memory_limit="1MiB", cache=False, restore=(model, optimizer))
    assert SCHEDULER.state_dict() == before
