"""Review 31: the docs' recipe for keeping the samples per step under ``find_executable_batch_size``
(``accelerator.gradient_accumulation_steps = 512 // batch_size`` at the function's top) judged
against the accumulation at the call's start, not the one the function's first attempt set.

* ``Accelerator()`` (1 micro-batch) with the recipe and the default ×0.9 retry: 64 x 8 asked for
  512, the retry at 57 trained 57 x 8 = 456 a step, silently (1 at the start: "no accumulation").
* ``Accelerator(gradient_accumulation_steps=2)`` with the recipe for 512 and a halving retry: 32 x 16
  trained the 512 asked, and the warning said "64 x 2 = 128 were asked" and told the user to set
  ``128 // batch_size``, which would have broken the run they had right.
"""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from autobatch import find_executable_batch_size  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))


@pytest.mark.parametrize("at_start, halving, said", [
    (1, False, "trains 456 samples per process where 64 x 8 = 512 were asked"),
    (2, True, None),
])
def test_review31_the_recipe_s_samples_per_step_are_those_its_first_attempt_asked(at_start, halving, said):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=at_start)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    @find_executable_batch_size(starting_batch_size=64,
                                reduce_batch_size_fn=(lambda: train.batch_size // 2) if halving else None)
    def train(batch_size):
        accelerator.gradient_accumulation_steps = 512 // batch_size  # the docs' recipe
        loader = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=batch_size))
        for i, (x, y) in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if batch_size == 64 and i == 1:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                optimizer.step()
                optimizer.zero_grad()
        return batch_size

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            size = train()
    finally:
        accelerator.gradient_accumulation_steps = 1  # shared by every Accelerator of the process
        accelerator.gradient_state.dataloader_references = [None]
    messages = [str(w.message) for w in caught if "gradient_accumulation_steps" in str(w.message)]
    assert size == (32 if halving else 57)
    if said is None:
        assert not messages, messages
    else:
        assert len(messages) == 1 and said in messages[0], messages
        assert "as 57 does not divide 512, pass `reduce_batch_size_fn=lambda: train.batch_size // 2`" in messages[0]
