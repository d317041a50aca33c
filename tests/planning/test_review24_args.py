"""Review 24: plan()'s timing counts (``warmup_steps``, ``timed_steps``, ``retime_rounds``) are
checked by the shared :func:`autobatch.checks.count`, as the rest of the public API's integers:
a whole float or a string of digits is told what to pass (``pass an int, e.g. timed_steps=4``),
where plan() said only "must be an integer >= 1, got 4.0"."""

from __future__ import annotations

import numpy as np
import pytest

from autobatch import plan

from workloads import plan_step as make_step, stacked_mlp as deep_mlp


@pytest.mark.parametrize("name, value, fix", [
    ("timed_steps", 4.0, "timed_steps=4"),
    ("warmup_steps", "2", "warmup_steps=2 (not the string '2')"),
    ("retime_rounds", np.float64(3.0), "retime_rounds=3"),
])
def test_a_whole_float_or_digit_string_count_is_told_the_int_to_pass(name, value, fix):
    with pytest.raises(ValueError) as raised:
        plan(make_step(deep_mlp()), global_batch=8, objective="throughput", **{name: value})
    message = str(raised.value)
    assert message.startswith(f"{name} must be an integer >= ") and message.endswith(f"; pass an int, e.g. {fix}"), message
