"""Review 35: ``find_executable_batch_size`` over a function that makes its ``Accelerator()`` inside
(Accelerate's pattern: ``accelerator = Accelerator(gradient_accumulation_steps=4); model, optimizer,
loader = accelerator.prepare(...)`` at its top). The retry works and each failed attempt's prepared
model and optimizer are freed with its Accelerator (every attempt starts from the same memory), but
a retry from 256 x 4 = 1024 samples a step to 146 x 4 = 584 was silent: the warning an Accelerator
made outside gets looked for a live Accelerator and an optimizer that stepped when the call
returned, and both had died with the attempt that ran."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from autobatch import find_executable_batch_size, simulated_memory  # noqa: E402
from test_review21t_accelerate_free import decorated_bf16_step  # noqa: E402 (beside this file)

DATA = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))


@pytest.fixture
def shared_accumulation():
    """The accumulation the Accelerators made inside leave in Accelerate's shared state, put back."""
    yield
    state = GradientState()
    state.plugin_kwargs.update(num_steps=1)
    state.dataloader_references = [None]


def test_review35_an_accelerator_made_inside_frees_each_attempt_and_says_the_samples_per_step(shared_accumulation):
    @find_executable_batch_size(starting_batch_size=256)
    def train(batch_size):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
        model = torch.nn.Sequential(torch.nn.Linear(16, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
        loader = torch.utils.data.DataLoader(DATA, batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, torch.optim.Adam(model.parameters()), loader)
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        return batch_size

    with simulated_memory("4MiB"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        size = train()
    said = [str(w.message) for w in caught if "gradient_accumulation_steps" in str(w.message)]
    assert size < 256 and len(train.attempts) > 1
    assert {attempt.start_bytes for attempt in train.attempts} == {0}  # the failed attempts' memory came back
    assert len(said) == 1
    assert f"trains {size * 4} samples per process where 256 x 4 = 1024 were asked" in said[0]
    assert "Accelerator(gradient_accumulation_steps=1024 // batch_size)" in said[0]


def test_review37_a_second_call_collects_the_last_calls_bf16_accelerator_first(shared_accumulation):
    """Review 37: Accelerate's decorator collects garbage at each call's start; this one did not, and a
    bf16 model an Accelerator made inside prepared holds itself (a cycle), so it outlived the call: the
    next call (a new epoch, a notebook cell run again) failed at the size that had run, and ran smaller."""
    AcceleratorState._reset_state()  # bf16: the process's state as a fresh one (and after: below)
    train = decorated_bf16_step(lambda: accelerate.Accelerator(cpu=True, mixed_precision="bf16"), free=False)
    try:
        with simulated_memory("2MiB"):
            first = train()
            calls = len(train.attempts)
            assert train() == first  # it failed at `first` and ran smaller
    finally:
        AcceleratorState._reset_state()
    assert [attempt.ok for attempt in train.attempts[calls:]] == [True]
