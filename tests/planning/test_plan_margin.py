"""plan(margin=m): the margin is taken once, off the micro-batch the plan rests on, and never
off a global batch that fits in one step.

It was taken twice (off the one-step answer, then again off the accumulated probe's answer,
capped at the reduced one), and off the global batch itself when that was the probe's cap: a
global batch of 100 that fitted about 480 was split 50 x 2 at margin=0.05.
"""

from __future__ import annotations

import math

import pytest

from autobatch import plan
from autobatch.planning.throughput import balanced_micro_batch

from workloads import plan_step as make_step, stacked_mlp as deep_mlp


@pytest.mark.parametrize("objective", ["max_batch", "throughput"])
def test_a_global_batch_that_fits_takes_no_margin(objective):
    """64 MiB fits several hundred samples: 100 is the probe's cap, no OOM is seen below it."""
    timing = dict(timed_steps=1, warmup_steps=0, retime_rounds=0, min_micro_batch=50) if objective == "throughput" else {}
    result = plan(make_step(deep_mlp()), global_batch=100, memory_limit="64MiB", steps_per_trial=1, margin=0.05,
                  objective=objective, **timing)
    assert [p["accumulating"] for p in result.probes] == [False]  # no accumulated probe: nothing to split
    if objective == "throughput":  # the one-step plan is a candidate (the timing picks the winner)
        assert max((c["micro_batch"], -c["accumulation_steps"]) for c in result.candidates) == (100, -1)
    else:
        assert (result.micro_batch, result.accumulation_steps) == (100, 1)


def test_the_margin_is_taken_once_off_the_accumulated_boundary():
    result = plan(make_step(deep_mlp()), global_batch=64, memory_limit="2MiB", steps_per_trial=1, margin=0.2)
    one_step, accumulated = (p["result"] for p in result.probes)
    assert [p["accumulating"] for p in result.probes] == [False, True]
    # the accumulated probe runs without a margin, up to the one-step boundary before its margin
    assert accumulated["margin"] == 0 and accumulated["max_batch"] == one_step["largest_passed"]
    largest = math.floor(accumulated["batch_size"] * 0.8)
    assert result.micro_batch == balanced_micro_batch(64, largest)
    assert any("margin 20% taken once" in note for note in result.notes)
    # without a margin the same probes answer the boundary itself
    plain = plan(make_step(deep_mlp()), global_batch=64, memory_limit="2MiB", steps_per_trial=1)
    assert plain.micro_batch == balanced_micro_batch(64, plain.probes[1]["result"]["batch_size"])
    assert result.micro_batch <= plain.micro_batch


def test_the_margin_keeps_micro_batches_multiples():
    result = plan(make_step(deep_mlp()), global_batch=64, memory_limit="2MiB", steps_per_trial=1, margin=0.2,
                  multiple_of=4)
    accumulated = result.probes[1]["result"]
    assert result.micro_batch == max(4, math.floor(accumulated["batch_size"] * 0.8) // 4 * 4)
    assert all(size % 4 == 0 for size in result.micro_batch_sizes)


def test_no_margin_off_a_micro_batch_only_max_batch_capped():
    """max_batch=16 far below the memory boundary: 16 x 4, as at margin 0 (it was 11 x 6)."""
    result = plan(make_step(deep_mlp()), global_batch=64, memory_limit="64MiB", steps_per_trial=1, margin=0.1,
                  max_batch=16)
    assert (result.micro_batch, result.accumulation_steps) == (16, 4)
