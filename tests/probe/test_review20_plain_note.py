"""A plain callable probed without ``restore`` trains the model for real, as documented; its result
now says so (``autobatch.probe.snapshot.unrestored.trained_for_real_note``), where nothing did and the
README's "a probe never leaves your model changed" read as covering it (found by the docs round)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autobatch


@pytest.mark.parametrize("restored", [False, True])
def test_a_plain_callable_without_restore_is_told_its_trials_trained(restored):
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step(batch_size):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(batch_size, 16)), torch.randint(0, 4, (batch_size,))).backward()
        optimizer.step()

    restore = (model, optimizer) if restored else None
    result = autobatch.find_max_batch(step, memory_limit="256KiB", strategy="binary", steps_per_trial=1, restore=restore)
    told = [note for note in result.notes if "trained the model for real" in note]
    assert torch.equal(model.weight, before) is restored
    assert (told == []) is restored and (restored or "SGD stepped" in told[0]), result.notes


@pytest.mark.parametrize("steps", [False, True])
def test_review31_a_plain_callable_that_returns_its_loss_unstepped_is_told(steps):
    """A plain callable that returns its loss for the caller's backward() and step() ran forward only
    in the trials: its answer held no gradients or optimizer state (an MLP under 4 MiB answered 3256
    where the whole step fits 2305), and nothing said so. One that steps and returns its loss is not told."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch_size):
        loss = F.cross_entropy(model(torch.randn(batch_size, 16)), torch.randint(0, 4, (batch_size,)))
        if steps:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss

    result = autobatch.find_max_batch(step, memory_limit="256KiB", strategy="binary", steps_per_trial=1,
                                      restore=(model, optimizer), cache=False)
    told = [note for note in result.notes if "no optimizer stepped" in note]
    assert (told == []) is steps and (steps or "loss.backward(), optimizer.step()" in told[0]), result.notes


@pytest.mark.parametrize("made", ["model inside", "both inside", "both outside"])
def test_review31_an_optimizer_that_steps_no_gradient_is_told(made):
    """An optimizer made outside fn over a model fn makes at each call steps nothing: the answer held no
    optimizer state (an MLP under AdamW capped at 40 MiB answered 2103 where 1799 trains), and nothing said
    so. Model and optimizer made together, both inside fn or both outside it, are not told."""
    outer = nn.Linear(16, 4)
    outer_optimizer = torch.optim.AdamW(outer.parameters())

    def step(batch_size):
        model = outer if made == "both outside" else nn.Linear(16, 4)
        optimizer = torch.optim.AdamW(model.parameters()) if made == "both inside" else outer_optimizer
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(batch_size, 16)), torch.randint(0, 4, (batch_size,))).backward()
        optimizer.step()

    result = autobatch.find_max_batch(step, memory_limit="256KiB", strategy="binary", steps_per_trial=1, cache=False,
                                      restore=(outer, outer_optimizer) if made == "both outside" else None)
    told = [note for note in result.notes if "stepped no parameter with a gradient" in note]
    assert (told == []) is (made != "model inside"), result.notes
    assert made != "model inside" or "restore=(model, optimizer)" in told[0]
    # made together at each call and stepped once: the state never sat beside a forward pass
    fresh = [note for note in result.notes if "made a new optimizer and stepped it once" in note]
    assert (fresh == []) is (made != "both inside"), result.notes
