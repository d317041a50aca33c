"""Review 20: ``find_executable_batch_size`` beside an ``accelerate.Accelerator`` as its users write it.

* ``Accelerator(gradient_accumulation_steps=4)`` with a start of 64 asks for 256 samples a step;
  a retry at 57 trained 228 a step, silently (Accelerate's decorator too; Transformers'
  ``auto_find_batch_size`` is the same bug, transformers#33281). Now one ``RuntimeWarning`` says
  so, unless the function keeps the product (sets the accumulation from its batch size) or trains
  nothing (an inference helper).
* A prepared loader whose loop the failure ended stayed Accelerate's active data loader after the
  call: ``gradient_state.in_dataloader`` stayed True, and where the attempt failed at its last
  batch, ``accelerator.accumulate`` in a later loop synced every micro-batch (no accumulation).
"""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from autobatch import find_executable_batch_size  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))


@pytest.fixture
def accelerator():
    """An Accelerator accumulating 4 micro-batches; the shared accumulation is put back after."""
    made = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    yield made
    made.gradient_accumulation_steps = 1  # shared by every Accelerator of the process
    made.gradient_state.dataloader_references = [None]


def _train(accelerator, mode, fail_at):
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    @find_executable_batch_size(starting_batch_size=64,
                                reduce_batch_size_fn=(lambda: train.batch_size // 2) if mode == "kept" else None)
    def train(batch_size):
        if mode == "kept":  # the fix the warning names: the samples per step held
            accelerator.gradient_accumulation_steps = 256 // batch_size
        loader = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=batch_size))
        for i, (x, y) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                if batch_size == 64 and i == fail_at:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                if mode != "inference":
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        return batch_size

    return train, model, optimizer


@pytest.mark.parametrize("mode, warned", [("changed", True), ("kept", False), ("inference", False)])
def test_a_retry_that_changes_the_samples_per_accumulated_step_is_said(accelerator, mode, warned):
    train, _, _ = _train(accelerator, mode, fail_at=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        size = train()
    said = [str(w.message) for w in caught if "gradient_accumulation_steps" in str(w.message)]
    assert size == (32 if mode == "kept" else 57) and len(said) == int(warned)
    if warned:
        assert "trains 228 samples per process where 64 x 4 = 256 were asked" in said[0]
        assert "accelerator.gradient_accumulation_steps = 256 // batch_size" in said[0]


def test_the_failed_loops_loader_is_no_longer_accelerates_active_one(accelerator):
    train, model, optimizer = _train(accelerator, "changed", fail_at=3)  # 256 / 64: its last batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert train() == 57
    assert not accelerator.gradient_state.in_dataloader
    synced = []
    for _ in range(8):  # a later loop over batches it makes itself
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(4, 16)).sum())
            optimizer.step()
            optimizer.zero_grad()
            synced.append(accelerator.sync_gradients)
    assert synced == [False, False, False, True] * 2  # it synced every micro-batch


@pytest.mark.parametrize("budget, freed", [("1MiB", False), ("4MiB", False), ("4MiB", True)])
def test_an_accelerator_keeping_each_attempts_model_is_named(accelerator, budget, freed):
    """``accelerator.prepare`` inside the function, without ``accelerator.free_memory()``: every
    failed attempt's model and optimizer stay prepared, each retry starts with less memory, and the
    search ended at batch 1 advising gradient accumulation (or answered a size far too small: 126
    where 162 runs with the call)."""
    from autobatch import NoBatchFitsError, simulated_memory

    @find_executable_batch_size(starting_batch_size=256)
    def train(batch_size):
        if freed:
            accelerator.free_memory()
        model = torch.nn.Sequential(torch.nn.Linear(16, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
        model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters()))
        accelerator.backward(model(torch.randn(batch_size, 16)).sum())
        optimizer.step()
        return batch_size

    with simulated_memory(budget), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if budget == "1MiB":
            with pytest.raises(NoBatchFitsError, match=r"something outside `train` keeps what its failed attempts "
                                                       r"made.*accelerator\.free_memory\(\) at the top"):
                train()
            return
        size = train()
    said = [str(w.message) for w in caught if "keeps what its failed attempts made" in str(w.message)]
    assert len(said) == int(not freed) and (not said or f"Batch {size} is smaller than the device allows" in said[0])
