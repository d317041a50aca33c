"""Review 25: Accelerate's canonical example (``accelerator.free_memory()``, a loader built and
``accelerator.prepare``d inside the decorated ``inner_training_loop``) switched to autobatch's
decorator. At a failure inside the prepared loader's loop, the check for a ``transformers.Trainer``
read ``f_locals`` of every traceback frame, the decorator's own running frame first: on Python
< 3.13 that snapshots its locals, the caught exception included, into a dict the live frame keeps,
so the exception's traceback pinned every frame of the failed attempt, and its activations, through
the retries. An MLP under 600 KiB that Accelerate's decorator trains at 167 reached batch 1 and
raised ``NoBatchFitsError``: every retry started with the first attempt's 580 KiB still in use (that MLP, in the session that fixed it)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerator_cpu import accelerator  # noqa: E402,F401 - the fixture
from autobatch import find_executable_batch_size, simulated_memory  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))


def test_a_failed_attempt_inside_a_loader_prepared_inside_is_freed_before_the_retry(accelerator):
    held: list[weakref.ref] = []
    alive_at_retry: list[bool] = []

    @find_executable_batch_size(starting_batch_size=16)
    def inner_training_loop(batch_size):
        accelerator.free_memory()
        if held:
            gc.collect()  # only a reference still held, not a cycle, keeps it now
            alive_at_retry.append(held[-1]() is not None)
        loader = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=batch_size))
        for x, _ in loader:
            activation = torch.ones(batch_size, 1024)  # what the failed attempt's frames hold
            held.append(weakref.ref(activation))
            if batch_size > 8:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return batch_size

    assert inner_training_loop() == 8
    assert alive_at_retry and not any(alive_at_retry)  # True: the traceback was kept through the retries


def test_the_canonical_accelerate_loop_under_a_cap_finds_a_size_as_accelerates_decorator_does(accelerator):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 16), torch.randn(128, 1))

    def make(decorator):
        @decorator(starting_batch_size=128)
        def inner_training_loop(batch_size):
            accelerator.free_memory()
            model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            return batch_size
        return inner_training_loop

    with simulated_memory("160KiB"):
        theirs = make(accelerate.utils.find_executable_batch_size)()
        ours = make(find_executable_batch_size)()
    assert 1 < theirs < 128 and ours >= theirs  # 78: the first attempt stayed in memory
