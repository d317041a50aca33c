"""A plain callable's step that runs out of memory after ``scaler.unscale_(optimizer)`` (clipping
with fp16): with the scaler in ``restore``, the next trial unscales again. Before, the scaler kept
its mark and the next trial raised "unscale_() has already been called on this optimizer"."""

from __future__ import annotations

import threading

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
    """A scaler the callable reaches is put back without restore naming it (review 34, below); one
    held where the probe does not look (a ``threading.local``) still needs restore to name it."""
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _step_failing_after_unscale(model, optimizer, torch.amp.GradScaler("cpu"), hidden=True)
    with pytest.raises(RuntimeError, match="unscale_") as caught:
        find_max_batch(step, memory_limit="64MiB", restore=(model, optimizer), cache=False)
    note = " ".join(caught.value.__notes__)
    assert "restore=(model, optimizer, scaler)" in note and "multiple_of" not in note


def test_review34_a_scaler_the_callable_reaches_is_put_back_without_restore_naming_it():
    """Review 34: ``restore=(model, optimizer)`` for a plain fp16 step left its ``GradScaler`` with the
    trials' scale (each good trial grew it, each overflow backed it off) and a trial that ran out of
    memory after ``unscale_`` ended the probe. The probe now finds a scaler the callable reaches, as it
    finds its LR scheduler, and puts it back."""
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    step = _step_failing_after_unscale(model, optimizer, scaler)
    step(4)  # a learned scale and growth tracker to keep
    before = scaler.state_dict()
    result = find_max_batch(step, memory_limit="64MiB", restore=(model, optimizer), cache=False)
    assert result.batch_size == 40 and scaler.state_dict() == before
    assert any("the GradScaler it steps" in note for note in result.notes)


def _step_failing_after_unscale(model, optimizer, scaler, hidden=False):
    held = threading.local() if hidden else None  # a thread-local is not walked by the probe's search
    if hidden:
        held.scaler, scaler = scaler, None

    def step(batch_size: int) -> None:
        scaler_ = held.scaler if hidden else scaler
        optimizer.zero_grad(set_to_none=True)
        scaler_.scale(model(torch.randn(batch_size, 8)).square().mean()).backward()
        scaler_.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if batch_size > 40:  # where clipping's and the step's temporaries no longer fit
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        scaler_.step(optimizer)
        scaler_.update()

    return step
