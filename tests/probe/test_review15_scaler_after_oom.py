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


def test_review37_a_train_step_called_again_after_an_oom_in_its_optimizer_step_unscales_its_own_gradients():
    """Review 37: a ``TrainStep`` (or ``accumulated_step``) called again after a call that ran out of
    memory inside ``optimizer.step()`` kept the failed call's ``unscale_`` mark: without clipping it
    stepped the new gradients still scaled (SGD: weights of 0.4 became 42 to 133), with
    ``max_grad_norm`` it raised torch's "unscale_() has already been called on this optimizer"."""
    from autobatch import TrainStep, accumulated_step, split_batch

    x, y = torch.linspace(-2, 2, 64 * 6).reshape(64, 6), torch.linspace(1, -1, 64).reshape(64, 1)

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]).float(), batch[1])

    def parts():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return model, torch.optim.SGD(model.parameters(), lr=1e-2), torch.amp.GradScaler("cpu", init_scale=2.0**10)

    reference, optimizer, scaler = parts()  # PyTorch's AMP recipe, one step on the first 32 samples
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(reference, (x[:32], y[:32]))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    for clip, call in ((None, lambda step: step(32)),
                       (1e3, lambda step: accumulated_step(step, split_batch((x[:32], y[:32]), 16), global_batch=32))):
        model, optimizer, scaler = parts()
        step = TrainStep(model, optimizer, loss_fn, lambda n: (x[:n], y[:n]), autocast_dtype="float16", grad_scaler=scaler,
                         max_grad_norm=clip)
        real_step, failed = optimizer.step, []

        def failing_step(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory (injected inside optimizer.step)")
            return real_step(*args, **kwargs)

        optimizer.step = failing_step  # the update never began: the weights are untouched
        with pytest.raises(torch.OutOfMemoryError):
            step(64)
        call(step)
        assert scaler.get_scale() == 2.0**10 and failed  # no inf: the step was taken
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-4)


def test_review39_a_train_step_whose_scaler_skipped_every_trial_says_its_answer_holds_no_optimizer_state():
    """Review 39: a ``make_batch`` whose samples hold a NaN gives inf/NaN gradients at any scale, so
    the fp16 scaler skipped every trial's ``optimizer.step()``: no AdamW state was made, and the
    answer (37 under 60 000 bytes, where 27 trains with finite data) said nothing of it."""
    from torch import nn

    from autobatch import TrainStep

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 1))

    def make_batch(n):
        x = torch.randn(n, 6)
        x[0, 0] = float("nan")
        return x, torch.randn(n, 1)

    step = TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
                     make_batch, autocast_dtype=torch.float16, grad_scaler=torch.amp.GradScaler("cpu"))
    result = find_max_batch(step, memory_limit=60_000, cache=False, estimate_first=False)
    assert any("skipped the optimizer step in every trial" in note and "make_batch" in note for note in result.notes)
