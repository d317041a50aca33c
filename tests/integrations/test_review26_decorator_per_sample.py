"""A function that uses its batch size but fills the memory in pieces of one size (a tensor per
sample) fails at the capacity on the same request whatever the size, as one that ignores its size
does. Started at 3x what fits, the decorator took that for a fixed point after failures over a
factor 2 and raised ``NoBatchFitsError`` at 347 where 256 runs; a stop now needs failures over a
factor 4, and the search goes on to a size that runs."""

from __future__ import annotations

import torch

from autobatch import find_executable_batch_size, simulated_memory


def test_a_function_filling_memory_a_sample_at_a_time_is_searched_down_to_a_size_that_runs():
    with simulated_memory("64KiB"):
        @find_executable_batch_size(starting_batch_size=768)
        def train(batch_size):
            pieces = [torch.ones(64) for _ in range(batch_size)]  # 256 B a sample, each kept
            return sum(float(p.sum()) for p in pieces)

        assert train() > 0
    ran = train.attempts[-1]
    assert ran.ok and 200 <= ran.batch_size <= 256, [(a.batch_size, a.ok) for a in train.attempts]
