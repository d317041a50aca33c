"""Review 15b: what a failed attempt of ``find_executable_batch_size`` left outside the function.

* fp16 with a ``GradScaler`` and gradient clipping (``scaler.unscale_(optimizer)`` then
  ``clip_grad_norm_``): an attempt that ran out of memory after ``unscale_`` left the optimizer
  marked unscaled in the scaler, and the next, smaller attempt's ``unscale_`` raised
  "unscale_() has already been called on this optimizer since the last update()", a
  ``RuntimeError`` that ended the search. A mark the caller made before the call, on gradients
  the failed attempt left alone, is kept.
* ``accelerator.accumulate``: the failed attempt's micro-batches stayed counted in
  ``accelerator.step``, so the retry's first optimizer step came after one micro-batch of four."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.amp.grad_scaler import OptState

from autobatch import find_executable_batch_size, simulated_memory


def _fp16_setup() -> tuple[torch.nn.Linear, torch.optim.SGD, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=16.0)


def test_a_retry_after_an_oom_past_unscale_trains():
    model, optimizer, scaler = _fp16_setup()
    data = torch.randn(64, 16)

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        for i in range(0, 64, batch_size):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(data[i:i + batch_size]).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            torch.zeros(batch_size, 64 * 1024)  # 256 KiB a sample, after unscale_: 16 or more fail
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return batch_size

    with simulated_memory("4MiB"):
        assert train() < 16
    assert [a.ok for a in train.attempts] == [False, True]


def test_the_callers_own_unscale_stays_where_its_gradients_do():
    """A loop that unscaled (to clip) and then calls a decorated ``no_grad`` helper that runs out
    of memory once: its gradients are kept, so its mark is too (cleared, ``scaler.step`` would
    divide the gradients by the scale a second time)."""
    model, optimizer, scaler = _fp16_setup()
    scorer = torch.nn.Linear(16, 4096)

    @find_executable_batch_size(starting_batch_size=64)
    def score(batch_size):
        with torch.no_grad():
            return scorer(torch.randn(batch_size, 16)).sum().item()

    for step in range(2):  # a loop that has stepped (the decorator knows its optimizer), then unscales
        if step:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    unscaled = model.weight.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with simulated_memory("600KiB"):  # 64 x 4096 floats, 1 MiB: the first attempt fails
            score()
    assert [a.ok for a in score.attempts] == [False, True]
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED
    assert torch.equal(model.weight.grad, unscaled)


def test_an_accelerators_accumulation_windows_start_again_after_a_failed_attempt():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, optimizer, _ = _fp16_setup()
    model, optimizer = accelerator.prepare(model, optimizer)
    data, synced = torch.randn(64, 16), []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        for i in range(0, 64, batch_size):
            with accelerator.accumulate(model):
                accelerator.backward(model(data[i:i + batch_size]).pow(2).mean())
                synced.append((batch_size, accelerator.sync_gradients))
                if batch_size == 16 and i == 32:
                    torch.zeros(16, 64 * 1024)  # the third micro-batch of the first window runs out of memory
                optimizer.step()
                optimizer.zero_grad()
        return batch_size

    with simulated_memory("4MiB"):
        assert train() < 16
    assert [sync for size, sync in synced if size < 16][:4] == [False, False, False, True]
