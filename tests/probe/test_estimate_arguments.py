"""The estimates' arguments are checked as find_max_batch checks them: one ValueError naming
what to change, and never an answer above ``max_batch``."""

import pytest
import torch

import autobatch
from autobatch.memory.units import parse_bytes
from autobatch.probe.tracing.estimate import estimate_line, estimate_max_batch, estimate_memory

from workloads import make_mlp_step


@pytest.mark.parametrize("arguments, message", [
    (dict(max_batch=2, multiple_of=3), "max_batch=2 is smaller than multiple_of=3"),
    (dict(max_batch=5, multiple_of=8), "max_batch=5 is smaller than multiple_of=8"),
    (dict(max_batch=0), "max_batch must be a positive integer"),
    (dict(max_batch=-5), "max_batch must be a positive integer"),
    (dict(max_batch=2.5), "max_batch must be a positive integer"),
    (dict(multiple_of=0), "multiple_of must be a positive integer"),
    (dict(multiple_of=2.5), "multiple_of must be a positive integer"),
    (dict(steps=0), "steps must be a positive integer"),
])
@pytest.mark.parametrize("estimate", [estimate_max_batch, estimate_line], ids=["max_batch", "line"])
def test_bad_arguments_are_named(estimate, arguments, message):
    step = make_mlp_step(width=16, in_features=8)
    with pytest.raises(ValueError, match=message):
        estimate(step, "1MiB", **arguments)


@pytest.mark.parametrize("max_batch, multiple_of", [(2, 1), (10, 3), (7, 7), (100, 8)])
def test_the_answer_is_never_above_max_batch(max_batch, multiple_of):
    step = make_mlp_step(width=16, in_features=8)
    for estimate in (estimate_max_batch, estimate_line):
        answer = estimate(step, "1GiB", max_batch=max_batch, multiple_of=multiple_of)
        assert 0 < answer.batch_size <= max_batch and answer.batch_size % multiple_of == 0
        assert answer.batch_size == max_batch // multiple_of * multiple_of


@pytest.mark.parametrize("value", ["1e400", float("inf"), float("nan"), 10**400, "1e400GiB"])
def test_a_byte_count_too_large_to_be_a_number_is_a_value_error(value):
    with pytest.raises(ValueError, match="memory_limit"):
        parse_bytes(value)


def test_a_huge_whole_number_of_bytes_is_exact():
    assert parse_bytes(10**30 + 1) == 10**30 + 1


def test_a_step_without_make_batch_is_told_what_to_pass():
    step = make_mlp_step(width=16, in_features=8)
    no_batches = autobatch.TrainStep(step.model, step.optimizer, step.loss_fn, None)
    with pytest.raises(ValueError, match="no make_batch.*pass make_batch="):
        estimate_memory(no_batches, 4)
