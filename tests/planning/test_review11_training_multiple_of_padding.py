"""Review 11: a ``multiple_of`` plan takes the least-padded multiple for its number of steps.

With ``multiple_of`` > 1 the split is full pieces and a smaller last one (so every piece is a
multiple); the micro-batch was the largest multiple that fit, so 100 by 2 with 62 fitting was
planned 62 + 38. It is now the smallest multiple that needs no more steps: 50 + 50, the same
steps, a lower peak, as ``balanced`` does without ``multiple_of``.
"""

from __future__ import annotations

import pytest

from autobatch.planning.accumulation import micro_batch_sizes
from autobatch.planning.throughput import balanced_micro_batch, candidate_micro_batches


@pytest.mark.parametrize(("global_batch", "largest", "multiple_of", "expected"), [
    (100, 62, 2, 50),   # 62 + 38 before: 50 + 50
    (96, 40, 8, 32),    # 40, 40, 16 before: 32, 32, 32
    (20, 6, 2, 6),      # four steps need 6: 6, 6, 6, 2 (full pieces keep the multiple)
    (64, 24, 1, 22),    # without multiple_of: the balanced micro-batch, as before
    (64, 200, 8, 64),   # the whole batch fits: one step
])
def test_least_padded_multiple(global_batch, largest, multiple_of, expected):
    micro = balanced_micro_batch(global_batch, largest, multiple_of)
    assert micro == expected and micro <= largest and micro % multiple_of == 0
    sizes = micro_batch_sizes(global_batch, micro)
    assert sum(sizes) == global_batch and all(size % multiple_of == 0 for size in sizes)
    assert len(sizes) == len(micro_batch_sizes(global_batch, min(largest, global_batch)))  # no more steps


def test_candidates_are_least_padded_multiples():
    assert candidate_micro_batches(100, 62, smallest=1, multiple_of=2) == [2, 4, 8, 16, 26, 50]  # before: 32 and 62
    assert candidate_micro_batches(64, 24, smallest=1, multiple_of=8) == [8, 16, 24]
