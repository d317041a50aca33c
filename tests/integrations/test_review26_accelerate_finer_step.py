"""Review 26: after a failure just past the capacity (the measured bound allows more than ×0.9),
the decorator stepped ×0.9 like Accelerate's and landed on average 5 % below the largest size that
runs. Once a call it now steps ×0.95 there (``autobatch.integrations.decorator_steps``): closer, and
at most one attempt more than the ×0.9 chain, where a ×0.95 step at every such failure (a step of
many small allocations, the bound always just past the capacity) took up to twice the attempts."""

from __future__ import annotations

import functools

import torch

from autobatch import find_executable_batch_size, simulated_memory

CAP = "64KiB"


def work(batch_size: int) -> int:
    """A step of many small allocations (256 B a sample, kept): it fails just past the capacity."""
    kept = [torch.empty(256, dtype=torch.uint8) for _ in range(batch_size)]
    return len(kept)


def fits(batch_size: int) -> bool:
    try:
        with simulated_memory(CAP):
            work(batch_size)
    except torch.OutOfMemoryError:
        return False
    return True


@functools.cache
def largest() -> int:
    low, high = 1, 512  # the largest size that runs, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def test_a_failure_just_past_the_capacity_steps_finer_once_and_lands_closer_than_x09():
    best = largest()
    start = int(best * 1.04) + 1
    decorated = find_executable_batch_size(work, starting_batch_size=start)
    with simulated_memory(CAP):
        found = decorated()
    assert [a.next_from for a in decorated.attempts] == ["finer", None]
    assert int(start * 0.9) < found <= best and fits(found)  # ×0.9 would have run at int(start * 0.9)


def test_the_finer_step_is_taken_once_a_call_so_it_costs_at_most_one_attempt_more_than_x09():
    best = largest()
    start = int(best * 1.8)  # below 2x: failures at one point over sizes 2x apart stop the search
    chain = [start]  # Accelerate's ×0.9 chain from the same start
    while not fits(chain[-1]):
        chain.append(int(chain[-1] * 0.9))
    decorated = find_executable_batch_size(work, starting_batch_size=start)
    with simulated_memory(CAP):
        decorated()
    steps = [a.next_from for a in decorated.attempts]
    assert steps.count("finer") == 1 and steps[0] == "finer"  # the first failure, then ×0.9 (or the bound)
    assert len(decorated.attempts) <= len(chain) + 1
    assert decorated.attempts[-1].ok and all(not a.ok for a in decorated.attempts[:-1])
