"""A probe inside a ``simulated_memory`` block: its own snapshot is host memory, which the block's
budget does not count; a ``memory_limit`` of another size there is refused; and the clean-up
after an out-of-memory trial does not itself run out of a spent budget."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import TrainStep, find_max_batch, simulated_memory


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _batch(n):
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


def _model_and_adam(warm: bool):
    """~1 MiB of weights; ``warm``: Adam already has its moments (a resumed run)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters())
    if warm:
        _loss(model, _batch(4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_plain_callable_with_restore_answers_inside_the_block_what_memory_limit_answers():
    """Before: 627 with memory_limit="8MiB", 380 inside simulated_memory("8MiB") (the snapshot counted)."""
    model, optimizer = _model_and_adam(warm=True)

    def plain(n):
        optimizer.zero_grad()
        _loss(model, _batch(n)).backward()
        optimizer.step()

    limited = find_max_batch(plain, memory_limit="8MiB", cache=False, strategy="binary", restore=(model, optimizer))
    with simulated_memory("8MiB") as device:
        inside = find_max_batch(plain, cache=False, strategy="binary", restore=(model, optimizer))
        gc.collect()
        assert device.current_bytes == 0
    assert inside.batch_size == limited.batch_size


def test_a_train_step_answers_the_same_twice_in_one_block_and_leaves_nothing_counted():
    """Before: 627 then 462, with 2 MiB of re-made Adam state left counted against the block."""
    model, optimizer = _model_and_adam(warm=True)
    step = TrainStep(model, optimizer, _loss, _batch)
    limited = find_max_batch(step, memory_limit="8MiB", cache=False, strategy="binary").batch_size
    with simulated_memory("8MiB") as device:
        first = find_max_batch(step, cache=False, strategy="binary").batch_size
        second = find_max_batch(step, cache=False, strategy="binary").batch_size
        gc.collect()
        assert device.current_bytes == 0
    assert first == second == limited


def test_gradients_present_before_the_probe_take_none_of_the_block():
    """Before: their snapshot copies counted through every trial (462 against 380)."""
    model, optimizer = _model_and_adam(warm=False)
    step = TrainStep(model, optimizer, _loss, _batch)
    model(torch.randn(4, 256)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    limited = find_max_batch(step, memory_limit="8MiB", cache=False, strategy="binary").batch_size
    with simulated_memory("8MiB"):
        inside = find_max_batch(step, cache=False, strategy="binary").batch_size
    assert inside == limited
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_state_the_block_counted_before_the_probe_it_counts_after():
    """Made inside the block (counted), the optimizer state and gradients are made again by the
    restore; they must count again, or a later trial in the block would have their bytes free."""
    model, optimizer = _model_and_adam(warm=False)
    step = TrainStep(model, optimizer, _loss, _batch)
    with simulated_memory("16MiB") as device:
        step(4)  # Adam's moments, inside the block
        _loss(model, _batch(4)).backward()  # gradients, inside the block
        gc.collect()
        before = device.current_bytes
        assert before > 2 * sum(p.numel() * 4 for p in model.parameters())
        find_max_batch(step, cache=False, strategy="binary", steps_per_trial=2)
        gc.collect()
        assert device.current_bytes == before
        assert all(p.grad is not None for p in model.parameters())


def test_a_memory_limit_inside_a_block_of_another_size_is_one_error():
    """Before: the answer was bounded by the block's 8 MiB, labelled and cached as 32 MiB's."""
    model, optimizer = _model_and_adam(warm=False)
    step = TrainStep(model, optimizer, _loss, _batch)
    for cache in (None, False):
        with simulated_memory("8MiB"), pytest.raises(ValueError) as caught:
            find_max_batch(step, memory_limit="32MiB", cache=cache)
        message = str(caught.value)
        assert "32.00 MiB" in message and "8.00 MiB" in message and "drop memory_limit" in message
        assert "outside the simulated_memory block" in message and "\n" not in message
    with simulated_memory("8MiB"), pytest.raises(ValueError, match="memory_limit=4.00 MiB"):
        autobatch.find_max_batch(step, memory_limit="4MiB", strategy="estimate")
    with simulated_memory("8MiB"):  # the block's own size asks what the block does
        assert find_max_batch(step, memory_limit="8MiB", cache=False, strategy="binary").batch_size > 1


def test_the_clean_up_after_an_oom_does_not_run_out_of_a_spent_budget():
    """Before: the drain's empty backward raised a raw OutOfMemoryError out of find_max_batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with pytest.raises(autobatch.NoBatchFitsError):
        find_max_batch(lambda n: model(torch.randn(n, 16)).sum().backward(), memory_limit=10, strategy="binary",
                       cache=False)
