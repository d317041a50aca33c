"""Where the model and its optimizer state alone do not fit, every attempt of a decorated function
ran out of memory at the optimizer's first step, with the memory in use there barely shrinking
with the size: the decorator walked x0.9 down to batch 1 (43 attempts, 27 s for an AdamW MLP
under 1 MiB) and then advised gradient accumulation, which cannot help. Now three failures on one
allocation, on a line of the size whose value at batch 1 is over the capacity, jump
(``next_from == "fixed_point"``), and at batch 1 the error says the fixed part does not fit.
The same line fits a function that fills memory a sample at a time: it must still run at the
largest size its pieces allow, and one whose fixed part fits must never jump."""

from __future__ import annotations

import pytest
import torch

from autobatch import NoBatchFitsError, find_executable_batch_size, simulated_memory
from autobatch.memory.oom import is_oom_error


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_size: int, kept: int = 0) -> None:
    x, y = torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    held = torch.ones(batch_size, kept) if kept else None  # batch-dependent memory alive at the step
    optimizer.step()
    optimizer.zero_grad()
    del held


def test_a_model_whose_optimizer_state_alone_does_not_fit_jumps_to_batch_1_and_says_so():
    with simulated_memory("256KiB"):
        @find_executable_batch_size(starting_batch_size=64)
        def train(batch_size):
            model = _mlp()  # 77 KB of weights, as much of gradients, twice that of AdamW state
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _step(model, optimizer, batch_size)
            return batch_size

        with pytest.raises(NoBatchFitsError) as error:
            train()
    message = str(error.value)
    assert "fixed in size" in message and "gradient accumulation and a smaller batch cannot help" in message
    assert "FSDP" in message and "use gradient accumulation" not in message
    jumps = [attempt for attempt in train.attempts if attempt.next_from == "fixed_point"]
    assert jumps and train.attempts[-1].batch_size == 1
    walked = train.attempts.index(jumps[0])  # a x0.9 walk from the jump down to 1 takes many more
    assert len(train.attempts) - walked <= 4 < jumps[0].batch_size


def test_a_function_filling_memory_a_sample_at_a_time_after_its_inputs_still_runs_its_largest_size():
    def body(batch_size):
        inputs = torch.zeros(batch_size, 4)  # 16 B a sample: the memory at the failure shrinks with the size
        pieces = [torch.ones(1024) for _ in range(batch_size)]  # 4 KiB a sample, each kept
        return float(inputs.sum()) + len(pieces)

    with simulated_memory("64KiB"):
        train = find_executable_batch_size(body, starting_batch_size=256)
        train()
        ran = train.attempts[-1]
        with pytest.raises(Exception) as larger:
            body(ran.batch_size + 1)
    assert ran.ok and is_oom_error(larger.value), [(a.batch_size, a.next_from) for a in train.attempts]


def test_a_function_whose_fixed_part_fits_never_jumps():
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with simulated_memory("512KiB"):
        @find_executable_batch_size(starting_batch_size=256)
        def train(batch_size):
            optimizer.state.clear()  # each attempt's step allocates the state: one fixed request
            _step(model, optimizer, batch_size, kept=256)  # 1 KiB a sample held at the step
            return batch_size

        train()
    assert train.attempts[-1].ok and len(train.attempts) > 3
    assert all(attempt.next_from != "fixed_point" for attempt in train.attempts)


def test_batch_1_failing_on_memory_that_grows_with_the_size_does_not_advise_accumulation():
    """Each size's one allocation grows with it, but even batch 1's is over the cap: no fixed point,
    and the generic message no longer advises gradient accumulation, which cannot go below batch 1."""

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        torch.empty((8 * batch_size + 1020) * 256, dtype=torch.float32)  # (8 x batch + 1020) KiB under 1 MiB

    with simulated_memory("1MiB"), pytest.raises(NoBatchFitsError) as info:
        train()
    message = str(info.value)
    assert "reached batch 1" in message and "nor gradient accumulation) can help" in message
    assert "use gradient accumulation" not in message


def test_review34_failures_whose_bytes_the_message_rounds_still_make_the_line():
    """Review 34: an AdamW MLP ``accelerator.prepare``d outside the function, its state not fitting a
    1.17 MiB cap, failed at the optimizer's step from 188 down; the bytes in use, read from the
    message ("1.15 MiB already in use", to 0.01 MiB), made steps, not a line, so the search walked
    x0.9 to batch 1 (27 attempts, where the exact figures jump after 3: 9)."""
    from autobatch.integrations.decorator import Attempt
    from autobatch.integrations.decorator_fixed import fixed_point
    from autobatch.memory.units import format_bytes

    def failed(size: int, in_use: int) -> Attempt:
        error = (f"Simulated out of memory. Tried to allocate 256.00 KiB in aten.div.Tensor; the simulated device "
                 f"has a budget of 1.17 MiB, {format_bytes(in_use)} already in use, "
                 f"{format_bytes(1228800 - in_use)} free (autobatch.simulated_memory).")
        return Attempt(size, False, 0.0, start_bytes=0, failed_at_bytes=in_use, requested_bytes=262144,
                       capacity_bytes=1228800, error=error)

    point = fixed_point([failed(188, 1205862), failed(155, 1195376), failed(129, 1195376)])  # as the message reads
    assert point is not None and point.needed > point.capacity
