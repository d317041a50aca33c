"""A whole number passed as a float (``max_batch=64.0``, from a division or a config read as
float) or as a string (``"64"``, from an environment variable) was refused with "must be a
positive integer, got 64.0", leaving the reader to find what was wrong: the message now says
what to pass."""

import numpy as np
import pytest

import autobatch
from autobatch import checks

from workloads import make_mlp_step


@pytest.mark.parametrize("value, hint", [
    (64.0, "got 64.0; pass an int, e.g. max_batch=64$"),
    (np.float64(64.0), "; pass an int, e.g. max_batch=64$"),
    ("64", "got '64'; pass an int, e.g. max_batch=64 \\(not the string '64'\\)"),
])
def test_a_whole_number_of_another_type_is_told_to_be_an_int(value, hint):
    with pytest.raises(ValueError, match=hint):
        checks.positive_int("max_batch", value)


@pytest.mark.parametrize("value", [64.5, 0.0, -3.0, float("nan"), "abc", True])
def test_no_hint_where_there_is_no_int_to_pass(value):
    with pytest.raises(ValueError) as raised:
        checks.positive_int("max_batch", value)
    assert "pass an int" not in str(raised.value)


def test_a_shape_and_a_number_say_what_to_pass_too():
    with pytest.raises(ValueError, match=r"got \[3\.0, 32, 32\]; pass ints, e.g. sample_shape=\[3, 32, 32\]"):
        checks.positive_shape("sample_shape", [3.0, 32, 32])
    with pytest.raises(ValueError, match=r"got '0\.1'; pass the number, e.g. margin=0\.1 \(not the string"):
        checks.positive_number("margin", "0.1")


def test_the_entry_points_say_it_at_the_call():
    with pytest.raises(ValueError, match="max_batch must be a positive integer or None, got 64.0; pass an int"):
        autobatch.find_max_batch(lambda n: None, max_batch=64.0)
    step = make_mlp_step(width=8, in_features=4)  # plan() checked max_batch by itself, without the hint
    with pytest.raises(ValueError, match="max_batch must be a positive integer or None, got 32.0; pass an int, e.g. max_batch=32"):
        autobatch.plan(step, global_batch=64, max_batch=32.0)
