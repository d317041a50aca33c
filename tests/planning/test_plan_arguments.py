"""plan()'s arguments and its advice: switches that must be real booleans, integers of any
integer type, ``start`` against the capped probes, the hint where checkpointing is off, and a
batch of no samples named as such."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import autobatch
from autobatch import NoBatchFitsError, plan
from autobatch.errors import NoBatchFitsError as Error
from autobatch.planning.accumulation import accumulate_gradients, micro_batch_sizes, split_batch

from workloads import plan_step as make_step, stacked_mlp as deep_mlp


@pytest.mark.parametrize("name", ["allow_accumulation", "allow_checkpointing", "balanced", "exhaustive"])
@pytest.mark.parametrize("value", ["false", None, 0, 1])
def test_switches_must_be_real_booleans(name, value):
    """allow_accumulation="false" planned accumulation, balanced=None unbalanced micro-batches."""
    with pytest.raises(ValueError, match=f"{name} must be True or False, got"):
        plan(make_step(deep_mlp()), global_batch=8, **{name: value})


def test_integers_of_any_integer_type_are_accepted_and_bool_or_float_refused():
    result = plan(make_step(deep_mlp()), global_batch=np.int64(64), max_batch=np.int64(32), memory_limit="64MiB",
                  steps_per_trial=1)
    assert (result.micro_batch, result.accumulation_steps) == (32, 2) and type(result.global_batch) is int
    sizes = micro_batch_sizes(np.int64(10), np.int32(4), balanced=True, min_micro_batch=np.int64(1))
    assert sizes == [4, 3, 3] and all(type(size) is int for size in sizes)
    for value in (True, 4.0):
        with pytest.raises(ValueError, match="micro_batch must be a positive integer"):
            micro_batch_sizes(10, value)
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        plan(make_step(deep_mlp()), global_batch=64.0)


def test_start_above_a_capped_probe_starts_at_its_cap():
    """The one-step probe fits about 15: the accumulated probe, capped there, refused start=32
    with a message naming max_batch=15, which the user never passed."""
    result = plan(make_step(deep_mlp()), global_batch=64, memory_limit="2MiB", steps_per_trial=1, start=32)
    one_step, accumulated = (p["result"] for p in result.probes)
    assert accumulated["max_batch"] == one_step["largest_passed"] < 32
    assert accumulated["trials"][0]["batch_size"] == accumulated["max_batch"]
    assert result.micro_batch * result.accumulation_steps >= 64


def test_start_above_the_global_batch_names_global_batch():
    with pytest.raises(ValueError, match="start=16 is larger than global_batch=8") as info:
        plan(make_step(deep_mlp()), global_batch=8, memory_limit="64MiB", start=16)
    assert "max_batch" not in str(info.value)


@pytest.mark.parametrize("objective", ["max_batch", "throughput"])
def test_checkpointing_off_and_batch_one_too_big_advises_allowing_it(objective):
    """It advised gradient accumulation (no micro-batch is below 1) and autobatch.plan (the
    call that raised), never allow_checkpointing."""
    with pytest.raises(NoBatchFitsError) as info:
        plan(make_step(deep_mlp(6)), global_batch=8, memory_limit=256 * 1024, steps_per_trial=1,
             allow_checkpointing=False, objective=objective, timed_steps=1, retime_rounds=0)
    message = str(info.value)
    assert "allow_checkpointing=True" in message and "gradient accumulation cannot help" in message
    assert "autobatch.plan" not in message and "smaller micro-batch" not in message
    assert info.value.batch_size == 1 and [p["fits"] for p in info.value.attempts] == [False]


def test_the_default_advice_at_batch_one_does_not_offer_a_smaller_micro_batch():
    message = str(Error(batch_size=1, capacity_bytes=1024, peak_bytes=1024, device="cpu"))
    assert "Batch 1 is the smallest micro-batch" in message and "smaller micro-batch (" not in message
    assert "checkpointing" in message and "precision" in message
    assert "smaller micro-batch (autobatch.plan)" in str(Error(batch_size=8, capacity_bytes=1, peak_bytes=1, device="cpu"))


def test_a_batch_of_no_samples_says_so():
    """It was blamed on global_batch, which the call never passed."""
    model = nn.Linear(4, 1)
    empty = torch.zeros(0, 4)
    for call in (lambda: accumulate_gradients(model, lambda m, b: m(b).mean(), empty, 4),
                 lambda: accumulate_gradients(model, lambda m, b: m(b).mean(), empty, 4, global_batch=8),
                 lambda: split_batch((empty, torch.zeros(0)), 2)):
        with pytest.raises(ValueError, match="the batch has 0 samples") as info:
            call()
        assert "global_batch" not in str(info.value)
    assert autobatch.split_batch(torch.zeros(3, 4), 2)[1].shape == (1, 4)  # any other size as before
