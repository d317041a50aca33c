"""Review 22: a data loader ``accelerator.prepare``d *outside* the decorated function (the
"Accelerate dataloaders" gap). It keeps the batch size it was built with, so no retry trains a
smaller batch. With a shuffled loader of variable-length samples each attempt failed on another
allocation, so the "fails at one point whatever its size" check never fired: 37 attempts down to
batch 1, then ``NoBatchFitsError`` advising gradient accumulation. Now the second failure inside
the same prepared loader, still at its own size, is one ``RuntimeWarning`` naming it and the fix,
and the final error names it too."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from autobatch import NoBatchFitsError, find_executable_batch_size, simulated_memory  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.randn(64, 4))


@pytest.fixture
def accelerator():
    made = accelerate.Accelerator(cpu=True)
    yield made
    made.gradient_state.dataloader_references = [None]


def _oom(batch):  # a different allocation at every failure, as shuffled variable-length batches make
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch.sum().abs().item() + 1:.2f} MiB")


def test_a_loader_prepared_outside_is_named_at_the_second_failure_and_in_the_error(accelerator):
    loader = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=16, shuffle=True))

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        for (x,) in loader:
            _oom(x)

    with warnings.catch_warnings(record=True) as caught, pytest.raises(NoBatchFitsError) as error:
        warnings.simplefilter("always")
        train()
    said = [str(w.message) for w in caught if "prepared" in str(w.message)]
    assert len(said) == 1 and "batch_size=16" in said[0] and "at batch 16 and at batch 14" in said[0]
    assert "accelerator.prepare(DataLoader(dataset, batch_size=batch_size))" in said[0]
    assert "batch_size=16" in str(error.value) and "gradient accumulation" not in str(error.value)


def test_a_loader_prepared_inside_at_the_size_is_not_named(accelerator):
    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        for (x,) in accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=batch_size)):
            if batch_size > 8:
                _oom(x)
        return batch_size

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        assert train() == 8


def test_a_retry_that_ran_through_a_loader_prepared_outside_says_the_size_returned_is_not_the_one_trained(accelerator):
    loader = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=16))
    trained = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        for i, (x,) in enumerate(loader):
            if batch_size == 16 and i == 2:  # a long batch mid-epoch, the first time only
                _oom(x)
            trained.append(len(x))
        return batch_size

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train() == 14
    said = [str(w.message) for w in caught if "prepared" in str(w.message)]
    assert trained[-1] == 16 and len(said) == 1  # it trained at the loader's 16, not at 14
    assert "ran at batch 14" in said[0] and "batch_size=16" in said[0] and "trained batches of 16" in said[0]


def test_the_callers_own_loop_over_a_prepared_loader_is_not_taken_for_the_functions(accelerator):
    outer = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=32))

    @find_executable_batch_size(starting_batch_size=16)
    def evaluate(batch_size, x):  # a helper called mid-epoch: its batches are its own
        if batch_size > 8:
            _oom(x[:batch_size])
        return batch_size

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [evaluate(x) for (x,) in outer] == [8, 8]


def test_an_attempt_starts_after_the_functions_own_free_memory(accelerator):
    """Accelerate's pattern: ``free_memory()`` at the top lets go of the failed attempt's prepared
    model and optimizer. Their bytes were counted as in use at the next attempt's start (read before
    the function ran), so a call that followed the advice was told to follow it: "the memory in use
    when each attempt started rose ... call accelerator.free_memory() at the top", "smaller than the
    device allows" (an MLP under 3 MiB: 291, where 330 does not run)."""

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        accelerator.free_memory()
        model = torch.nn.Linear(256, 256)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        if batch_size == 64:  # before any step
            raise torch.OutOfMemoryError("CUDA out of memory.")
        accelerator.backward(model(torch.randn(batch_size, 256)).pow(2).mean())
        optimizer.step()
        if batch_size == 57:  # after a step: the optimizer's moments exist
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    with simulated_memory("4MiB"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train() == 51
    assert [attempt.start_bytes for attempt in train.attempts] == [0, 0, 0]
    assert not [w for w in caught if "rose after its failed attempts" in str(w.message)]
