"""Review 19: hand loops under ``find_executable_batch_size``.

* A function that ignores its batch size (a ``DataLoader`` built outside it, with its own
  ``batch_size``) failed at the same point at every size, from the start down to batch 1, and
  then raised ``NoBatchFitsError`` advising gradient accumulation; it now stops once the failures
  are proved independent of the size, and the error asks whether the function uses its batch size.
* A retry runs the function from its top: with a model and optimizer passed in, the failed
  attempts' optimizer steps stay in the model and their samples are trained again, silently; now
  one ``RuntimeWarning`` says so, unless the retry loaded a checkpoint into that optimizer.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from autobatch import NoBatchFitsError, find_executable_batch_size, simulated_memory


def test_a_function_that_ignores_its_batch_size_is_named_not_searched_down_to_one():
    with simulated_memory("1MiB"):
        @find_executable_batch_size(starting_batch_size=2048)
        def train(batch_size):
            held = torch.ones(4096)  # the model, say: allocated before what fails
            return held.sum() + torch.ones(512 * 1024).sum()  # the loader's fixed batch: not batch_size

        with pytest.raises(NoBatchFitsError, match="Does `train` use the batch size it is given") as info:
            train()
    assert "DataLoader(dataset, batch_size=batch_size)" in str(info.value)
    assert len(train.attempts) <= 15  # 2048 down to below 512, not 39 attempts down to 1
    assert train.batch_size == 2048  # the next call searches from the start again


def _loop(mode: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved, kept = {"o": optimizer.state_dict()}, []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model, optimizer):
        if mode == "resumed":
            optimizer.load_state_dict(saved["o"])  # the loop's own checkpoint
        if mode == "made inside, kept outside":  # as an Accelerator created outside keeps what it prepared
            model = torch.nn.Linear(16, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            kept.append(optimizer)
        for step in range(4):
            if step == 2 and batch_size > 4:  # a long batch mid-epoch
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            model(torch.randn(batch_size, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return batch_size

    return train, model, optimizer


@pytest.mark.parametrize("mode", ["passed in", "resumed", "made inside, kept outside"])
def test_steps_a_failed_attempt_took_with_the_callers_optimizer_are_said(mode):
    train, model, optimizer = _loop(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(model, optimizer) == 4
    said = [str(w.message) for w in caught if "trained twice" in str(w.message)]
    assert len(said) == (1 if mode == "passed in" else 0)
    if said:  # 8, 7, 6 and 5 each stepped twice before failing
        assert "took 8 optimizer step(s)" in said[0] and "optimizer.load_state_dict" in said[0]
    assert not optimizer._optimizer_load_state_dict_post_hooks  # the watch leaves no hook behind
