"""A plain callable's step that runs out of memory after ``scaler.unscale_(optimizer)`` (clipping
with fp16): with the scaler in ``restore``, the next trial unscales again. Before, the scaler kept
its mark and the next trial raised "unscale_() has already been called on this optimizer"."""

from __future__ import annotations

import pytest
import torch

from autobatch import find_max_batch


def test_a_step_failing_after_unscale_leaves_the_next_trial_free_to_unscale():
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    step = _step_failing_after_unscale(model, optimizer, scaler)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = find_max_batch(step, memory_limit="64MiB", restore=(model, optimizer, scaler), cache=False)
    assert result.batch_size == 40
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_the_scaler_in_restore_the_error_says_to_pass_it():
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _step_failing_after_unscale(model, optimizer, torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="unscale_") as caught:
        find_max_batch(step, memory_limit="64MiB", restore=(model, optimizer), cache=False)
    note = " ".join(caught.value.__notes__)
    assert "restore=(model, optimizer, scaler)" in note and "multiple_of" not in note


def _step_failing_after_unscale(model, optimizer, scaler):
    def step(batch_size: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(torch.randn(batch_size, 8)).square().mean()).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if batch_size > 40:  # where clipping's and the step's temporaries no longer fit
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        scaler.step(optimizer)
        scaler.update()

    return step
