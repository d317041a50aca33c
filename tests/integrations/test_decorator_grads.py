"""autobatch.find_executable_batch_size after a failed attempt: only its gradients are dropped,
and a ``reduce_batch_size_fn`` is held to what the retries need (a smaller size, a multiple)."""

from __future__ import annotations

import warnings

import pytest
import torch

from autobatch import find_executable_batch_size, simulated_memory


def _model_and_optimizer(width: int = 16) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _half_way(model: torch.nn.Linear, optimizer: torch.optim.Optimizer) -> None:
    """A loop that has trained (its optimizer stepped: the decorator knows it without a scan of
    the live objects per call) and is half-way through an accumulation window."""
    model(torch.randn(8, model.in_features)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    model(torch.randn(8, model.in_features)).pow(2).mean().backward()  # the window's first micro-batch


def test_an_inference_helper_keeps_the_loops_accumulated_gradients():
    """A training loop half-way through an accumulation window calls a decorated ``no_grad``
    helper that runs out of memory once: the loop's gradients were wiped (every live optimizer's
    were set to None), so its next step trained on half the window."""
    model, optimizer = _model_and_optimizer()
    scorer, data = torch.nn.Linear(16, 4096), torch.randn(64, 16)

    @find_executable_batch_size(starting_batch_size=64)
    def score(batch_size):
        with torch.no_grad():
            return sum(scorer(data[i:i + batch_size]).sum().item() for i in range(0, 64, batch_size))

    _half_way(model, optimizer)
    accumulated, grad = model.weight.grad.clone(), model.weight.grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was lost: no warning
        with simulated_memory("600KiB"):  # 64 x 4096 floats, 1 MiB: the first attempt fails
            score()
    assert [a.ok for a in score.attempts] == [False, True]
    assert model.weight.grad is grad and torch.equal(grad, accumulated)


def test_the_failed_attempts_own_gradients_go_and_the_others_stay():
    """Two models under one optimizer each: the attempt trains one; after its OOM that one's
    gradients (created by the attempt) are gone, the other's (from before the call) untouched."""
    trained, trained_optimizer = _model_and_optimizer(64)
    other, other_optimizer = _model_and_optimizer(64)
    _half_way(other, other_optimizer)
    before = other.weight.grad.clone()
    grads_at_start = []

    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size):
        grads_at_start.append(trained.weight.grad is not None)
        trained(torch.randn(batch_size, 64)).pow(2).mean().backward()
        torch.zeros(batch_size, 64 * 1024)  # 256 KiB a sample: 16 or more fail under 4 MiB
        trained_optimizer.step()
        trained_optimizer.zero_grad()
        return batch_size

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with simulated_memory("4MiB"):
            assert train() < 16
    assert grads_at_start == [False] * len(train.attempts) and len(train.attempts) > 1
    assert torch.equal(other.weight.grad, before)


def test_gradients_the_failed_attempt_added_into_are_dropped_with_one_warning():
    """A gradient from before the call that the failed backward added into cannot be put back
    without a copy: dropped (or the next step applies the failed pass too), and one warning says
    what was lost and what to do."""
    model, optimizer = _model_and_optimizer(64)
    _half_way(model, optimizer)  # accumulated before the call
    grads_at_start = []

    @find_executable_batch_size(starting_batch_size=32)
    def accumulate(batch_size):
        grads_at_start.append(model.weight.grad is not None)
        model(torch.randn(batch_size, 64)).pow(2).mean().backward()
        torch.zeros(batch_size, 64 * 1024)  # the OOM comes after the backward
        return batch_size

    with simulated_memory("4MiB"), pytest.warns(RuntimeWarning, match="accumulated before the call are lost") as caught:
        assert accumulate() < 16
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert "start of an accumulation window" in str(caught[0].message)
    assert grads_at_start == [True] + [False] * (len(accumulate.attempts) - 1)
    assert model.weight.grad is not None and optimizer.param_groups[0]["params"][0] is model.weight


def test_a_reduce_fn_that_does_not_reduce_is_one_error():
    """It returned the size that failed: the retries ran for ever."""
    calls = []

    def same() -> int:
        calls.append(64)
        assert len(calls) < 5, "the retries go on at the size that failed"
        return 64

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=same)
    def train(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(ValueError, match="reduce_batch_size_fn returned 64 after batch 64 ran out of memory"):
        train()
    assert len(train.attempts) == 1

    @find_executable_batch_size(starting_batch_size=64, multiple_of=8, reduce_batch_size_fn=lambda: 70)
    def larger(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(ValueError, match=r"returned 70 \(rounded down to 64, a multiple of multiple_of=8\)"):
        larger()


def test_a_reduce_fns_sizes_are_rounded_to_multiple_of():
    """The docs say every size is a multiple of ``multiple_of``: a reduce_batch_size_fn's were
    tried as it returned them (128, 100, 50 with multiple_of=8)."""
    sizes = iter([100, 50, 5])

    @find_executable_batch_size(starting_batch_size=128, multiple_of=8, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size):
        if batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert train() == 5
    # rounded down to multiples; below multiple_of an answer is tried as it is (as the fallback's)
    assert [a.batch_size for a in train.attempts] == [128, 96, 48, 5]
