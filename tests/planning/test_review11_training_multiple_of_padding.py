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


def test_review39_throughput_times_several_multiples_of_a_multiple_of_that_is_no_power_of_two():
    """Review 39: the candidates were the powers of two that are multiples of ``multiple_of``: none is a
    multiple of 3, so ``multiple_of=3`` timed the largest alone ("fastest of 1 timed candidates"), a
    max_batch plan. Each power is rounded down to a multiple now. With a cost per sample that rises past
    8 (the fake clock of test_planner), 6 x 17 beats 33 x 3 (538 against 708 time units a step)."""
    import torch
    from torch import nn

    from autobatch import plan
    from test_planner import Costly, FakeClock, make_step

    assert candidate_micro_batches(960, 48, multiple_of=3) == [3, 6, 15, 30, 48]  # before: [48]
    clock = FakeClock()
    torch.manual_seed(0)
    model = nn.Sequential(*(Costly(clock, lambda n: 10 + n + 3 * max(0, n - 8)) for _ in range(2)))
    result = plan(make_step(model, tokens=2), global_batch=45, objective="throughput", multiple_of=3, max_batch=21,
                  memory_limit="64MiB", steps_per_trial=1, warmup_steps=0, timed_steps=1, retime_rounds=0,
                  timer=clock, cache=False, estimate_first=False)
    assert [c["micro_batch"] for c in result.candidates] == [3, 6, 15]  # before: 15 alone
    assert result.micro_batch_sizes == [6] * 7 + [3] and result.samples_per_s == 45 / 250
