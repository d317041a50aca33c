"""Review 21: the ``accelerator.free_memory()`` at the function's top (Accelerate's pattern, and
what the decorator's docs advise) under mixed precision. Accelerate's ``free_memory`` collects
garbage *before* it empties its lists, and a model prepared under bf16 holds itself (its forward
is bound to it, wrapped in autocast), so the failed attempt's model lived on through every retry:
a bf16 MLP under 2 MiB failed at every size down to batch 1 (``NoBatchFitsError`` advising
gradient accumulation) where 676 runs (at 2 MiB: 49 attempts, where 4 reach it). From the first failure the decorator's call gives each
live Accelerator a ``free_memory`` that collects after it, put back when the call ends."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState  # noqa: E402

from autobatch import find_executable_batch_size, simulated_memory  # noqa: E402


@pytest.fixture
def bf16():
    """An Accelerator under bf16 (the process's shared state reset before and after)."""
    AcceleratorState._reset_state()
    yield accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    AcceleratorState._reset_state()


def decorated_bf16_step(accelerator_of, free: bool = True):
    """A decorated function that frees memory at its top (Accelerate's pattern; not with ``free=False``),
    prepares a bf16 MLP with ``accelerator_of()`` (one made outside, or a new one each call) and takes one
    step; returns its size."""
    data = torch.randn(1024, 64)

    @find_executable_batch_size(starting_batch_size=1024)
    def train(batch_size):
        accelerator = accelerator_of()
        if free:
            accelerator.free_memory()
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 1))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        accelerator.backward(model(data[:batch_size]).float().pow(2).mean())
        optimizer.step()
        return batch_size

    return train


def test_free_memory_at_the_top_frees_the_failed_attempts_bf16_model(bf16):
    train = decorated_bf16_step(lambda: bf16)
    with simulated_memory("2MiB"):
        size = train()  # it raised NoBatchFitsError after 49 attempts
    assert size >= 600 and len(train.attempts) <= 5
    assert "free_memory" not in vars(bf16)  # Accelerate's own again after the call


def test_review37_second_call_frees_the_last_calls_bf16_model_before_its_first_attempt(bf16):
    """Review 37: the collecting ``free_memory`` came only from a call's first failure, so a second call
    (a new epoch, a notebook cell run again) started with the last call's bf16 model and optimizer state
    alive: its first attempt failed at the size that had run, and each call ran smaller."""
    train = decorated_bf16_step(lambda: bf16)
    with simulated_memory("2MiB"):
        first = train()
        calls = len(train.attempts)
        assert train() == first  # it failed at `first` and ran smaller
    assert [attempt.ok for attempt in train.attempts[calls:]] == [True]
    assert "free_memory" not in vars(bf16)
