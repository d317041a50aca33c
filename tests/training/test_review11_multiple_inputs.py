"""``Runner(multiple_of=)``'s arguments: one clear ``ValueError`` naming what to change, when the
runner is made (not at the first OOM); ``min_micro_batch`` is rounded up to a multiple."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner
from autobatch.training.multiples import multiple_options
from runner_workloads import make_model, mse


def _runner(**options) -> Runner:
    model = make_model()
    options = {"global_batch": 24, "micro_batch": 8, "progress": False, "log_every": None, **options}
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, **options)


@pytest.mark.parametrize("value", [0, -4, 2.5, "4", True, None])
def test_multiple_of_is_a_positive_integer(value):
    with pytest.raises(ValueError, match="multiple_of"):
        _runner(multiple_of=value)


def test_a_numpy_integer_is_taken():
    numpy = pytest.importorskip("numpy")
    assert _runner(multiple_of=numpy.int64(4)).multiple_of == 4


def test_a_global_batch_that_is_no_multiple_names_both_and_the_nearest():
    with pytest.raises(ValueError) as info:
        _runner(global_batch=30, multiple_of=4)
    message = str(info.value)
    assert "global_batch=30" in message and "multiple_of=4" in message and "28 or 32" in message
    assert str(info.value).count("\n") == 0


def test_the_batch_per_rank_is_what_must_be_a_multiple():
    with pytest.raises(ValueError, match=r"per rank \(12\) is not a multiple of multiple_of=8"):
        multiple_options(8, {}, share=12, micro_batch=None, max_micro_batch=None, min_micro_batch=1, balanced=True,
                         per_rank=True)


def test_a_micro_batch_that_is_no_multiple_is_refused():
    with pytest.raises(ValueError, match=r"micro_batch=6 is not a multiple of multiple_of=4; use 4 or 8"):
        _runner(micro_batch=6, multiple_of=4)


def test_a_max_micro_batch_below_the_multiple_is_refused_and_one_above_is_rounded_down():
    with pytest.raises(ValueError, match="max_micro_batch=2 is below multiple_of=4"):
        _runner(micro_batch=None, max_micro_batch=2, multiple_of=4)
    assert _runner(micro_batch=8, max_micro_batch=14, multiple_of=4).growth.ceiling == 12


def test_different_multiples_in_the_runner_and_the_plan_options_are_refused():
    with pytest.raises(ValueError, match=r"multiple_of=4 and plan_options\['multiple_of'\]=8 differ"):
        _runner(micro_batch=None, multiple_of=4, plan_options={"multiple_of": 8})
    assert _runner(micro_batch=None, plan_options={"multiple_of": 8}).multiple_of == 8  # adopted
    assert _runner(micro_batch=None, multiple_of=8, plan_options={"multiple_of": 8}).multiple_of == 8


def test_min_micro_batch_rounds_up_to_a_multiple_and_split_is_not_balanced():
    runner = _runner(min_micro_batch=5, multiple_of=4)
    assert runner.min_micro_batch == 8 and runner.balanced is False
    assert _runner(multiple_of=4).min_micro_batch == 4  # the default 1: the multiple itself is the floor
    assert _runner(multiple_of=1).min_micro_batch == 1 and _runner().balanced is True  # unchanged without one


def test_a_floor_the_batch_cannot_be_cut_by_names_it():
    with pytest.raises(ValueError) as info:
        _runner(global_batch=20, micro_batch=20, min_micro_batch=12, multiple_of=4)
    message = str(info.value)
    assert "multiple_of=4" in message and "min_micro_batch=12" in message and "global_batch=20" in message


def test_a_floor_rounded_above_max_micro_batch_is_refused():
    with pytest.raises(ValueError, match=r"min_micro_batch=5 rounds up to 8 with multiple_of=4, above max_micro_batch=6"):
        _runner(micro_batch=None, max_micro_batch=6, min_micro_batch=5, multiple_of=4)


def test_review39_a_prime_global_batch_names_the_divisors_as_plan_does():
    """Review 39: a prime global batch (97) with multiple_of=2 said "a multiple_of that divides 97", sending the
    user looking for one; plan() names what divides it (only 1), and so does the runner now, planned or not."""
    with pytest.raises(ValueError, match=r"divides 97 \(below 2, only 1 does: multiple_of=1 puts no constraint"):
        _runner(global_batch=97, micro_batch=None, plan_options={"multiple_of": 2, "objective": "throughput"})
    with pytest.raises(ValueError, match=r"of 96 or 104, or a multiple_of that divides 100 \(5, 4 or 2\)"):
        _runner(global_batch=100, micro_batch=None, multiple_of=8)
