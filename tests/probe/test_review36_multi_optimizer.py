"""Plain callables of several models or optimizers (a GAN, an EMA teacher) under ``restore`` (review 36)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autobatch


def test_review36_late_zeroed_gradients_are_held_after_a_failed_trial():
    """A step that zeroes a model's gradients late (a GAN's generator, through the discriminator's step) holds the
    last step's through its peak. The trial after a failed one began without them (the probe drops them), so short
    trials passed sizes that train no three steps, and the confirmations stepped down below the boundary: 893 here,
    where 900 trains. 900 samples of 1,000 B beside the 100,000 B gradient fill the 1,000,000 B budget exactly."""
    model = torch.nn.Linear(250, 100, bias=False)  # 100,000 B of weight, and of gradient
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(batch_size: int) -> None:
        activations = torch.ones(batch_size, 250)  # beside the last step's gradient, zeroed only below
        del activations
        optimizer.zero_grad(set_to_none=True)
        model(torch.ones(1, 250)).sum().backward()
        optimizer.step()

    step(1)
    with autobatch.simulated_memory(1_000_000):
        result = autobatch.find_max_batch(step, restore=(model, optimizer), strategy="binary", start=512)
    assert result.batch_size == 900
    assert model.weight.grad is not None  # put back as it was


def test_review36_an_ema_teacher_outside_restore_is_named():
    """An EMA teacher updated each step (DINO, BYOL) with ``restore=(student, optimizer)`` kept the trials' updates
    with no word; now a RuntimeWarning names it and says to pass it in restore, which puts it back."""
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    teacher = copy.deepcopy(student).requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters())

    def step(batch_size: int) -> None:
        x = torch.randn(batch_size, 16)
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = -(target * student(x).log_softmax(-1)).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.lerp_(s, 0.01)

    step(2)
    before = copy.deepcopy(teacher.state_dict())
    with autobatch.simulated_memory("1MiB"), pytest.warns(RuntimeWarning, match=r"Sequential's 0\.weight.*pass that module in restore"):
        autobatch.find_max_batch(step, restore=(student, optimizer), max_batch=16)
    teacher.load_state_dict(before)
    with autobatch.simulated_memory("1MiB"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # put back: nothing to tell
        autobatch.find_max_batch(step, restore=(student, optimizer, teacher), max_batch=16)
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())

