"""autobatch.find_executable_batch_size: a failed attempt's gradients, the rounded start, OOM
messages Accelerate retries, and coroutine functions."""

from __future__ import annotations

import warnings

import pytest
import torch

from autobatch import find_executable_batch_size, simulated_memory


def _model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_failed_attempts_gradients_are_dropped_before_the_next():
    """The backward ran, then a buffer ran out of memory before the step (the optimizer never
    stepped, so the step watch has not seen it): the next attempt must start without those
    gradients, or its step applies the sum of several backward passes and their bytes shrink
    the next size."""
    model, optimizer = _model_and_optimizer()
    grads_at_start = []

    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size):
        grads_at_start.append(model.weight.grad is not None)
        model(torch.randn(batch_size, 64)).pow(2).mean().backward()
        torch.zeros(batch_size, 64 * 1024)  # 256 KiB a sample: 16 or more fail under 4 MiB
        optimizer.step()
        optimizer.zero_grad()
        return batch_size

    with simulated_memory("4MiB"):
        found = train()
    assert found < 16 and len(train.attempts) > 1
    assert grads_at_start == [False] * len(train.attempts)
    assert all(a.start_bytes == 0 for a in train.attempts)


def test_gradients_are_untouched_when_no_attempt_fails():
    model, optimizer = _model_and_optimizer()

    @find_executable_batch_size(starting_batch_size=4)
    def accumulate(batch_size):
        model(torch.randn(batch_size, 64)).sum().backward()  # no step: the caller steps later
        return batch_size

    assert accumulate() == 4
    assert model.weight.grad is not None and optimizer.param_groups[0]["params"][0] is model.weight


def test_the_start_is_rounded_down_to_a_multiple():
    sizes = []

    @find_executable_batch_size(starting_batch_size=100, multiple_of=8)
    def train(batch_size):
        sizes.append(batch_size)
        if batch_size > 50:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert train() == 48
    assert sizes[0] == 96 and all(size % 8 == 0 for size in sizes)


def test_a_start_below_multiple_of_is_refused():
    with pytest.raises(ValueError, match="starting_batch_size 5 is below multiple_of 8"):
        find_executable_batch_size(lambda b: b, starting_batch_size=5, multiple_of=8)
    assert find_executable_batch_size(lambda b: b, starting_batch_size=8, multiple_of=8)() == 8


@pytest.mark.parametrize("message", [
    "NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity)",
    "MLU out of memory. Tried to allocate 2.00 GiB",
    "MUSA out of memory. Tried to allocate 2.00 GiB",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::2147483648 (2048)MB",
])
def test_every_oom_accelerate_retries_is_retried(message):
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        if batch_size > 4:
            raise RuntimeError(message)
        return batch_size

    assert train() == 4 and not train.attempts[0].ok


def test_an_async_function_is_refused_where_it_is_decorated():
    with pytest.raises(TypeError, match="cannot retry the coroutine function `train`"):
        @find_executable_batch_size(starting_batch_size=8)
        async def train(batch_size):
            return batch_size


def test_a_returned_coroutine_is_refused_and_closed():
    """A plain function that returns a coroutine is only seen when called: refused then, its
    coroutine closed (no "never awaited" warning), the attempt not recorded as a size that ran."""
    async def steps(batch_size):
        return batch_size

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        return steps(batch_size)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="returned a coroutine"):
            train()
    assert not any(a.ok for a in train.attempts)
