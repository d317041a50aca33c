"""A small byte count that is not whole (``simulated_memory(1.5)``, ``"1.5"``, ``"1.5B"``) is one
``ValueError`` naming what to give, where ``int()`` silently made it a 1-byte budget; the same
parser (:func:`autobatch.memory.units.parse_bytes`) serves ``find_max_batch(memory_limit=...)`` and
a Runner's ``plan_options``, so all three say the same. Valid counts keep their values."""

import pytest
import torch

import autobatch
from autobatch.memory.units import parse_bytes


def _message(call) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert not getattr(info.value, "__notes__", None)
    return str(info.value)


@pytest.mark.parametrize("value", [1.5, "1.5", "1.5B", 1023.5])
def test_a_count_of_bytes_that_is_not_whole_is_refused(value):
    text = _message(lambda: autobatch.simulated_memory(value).__enter__())
    assert f"limit={value!r} is" in text and "not a whole number of bytes" in text and "'512MiB'" in text


@pytest.mark.parametrize("value", [0, -3, float("nan"), True, "-1GiB"])
def test_other_bad_limits_each_say_what_to_give(value):
    text = _message(lambda: autobatch.simulated_memory(value).__enter__())
    assert "'512MiB'" in text or "'80GiB'" in text


def test_valid_counts_keep_their_values():
    # a large computed share (0.9 * total) is rounded down: a fraction of a byte changes nothing there
    whole = {"1.5GiB": 3 * 2**29, "0.5KiB": 512, 1024.0: 1024, 1e9: 10**9, "1e3": 1000, 7: 7, 2**30 + 0.25: 2**30}
    assert {value: parse_bytes(value) for value in whole} == whole


def test_the_probe_and_the_runner_give_the_simulation_s_message():
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autobatch.TrainStep(model, optimizer, lambda m, b: m(b).pow(2).mean(), make_batch=lambda n: torch.randn(n, 8))
    expected = _message(lambda: parse_bytes(1.5, name="memory_limit"))
    assert _message(lambda: autobatch.find_max_batch(step, memory_limit=1.5)) == expected
    # at Runner(...), naming plan_options (review 37: before, at fit(), once the first batch was loaded)
    assert _message(lambda: autobatch.Runner(model, optimizer, lambda m, b: m(b[0]).pow(2).mean(), global_batch=8,
                                             device="cpu", plan_options={"memory_limit": 1.5})) == \
        _message(lambda: parse_bytes(1.5, name="plan_options['memory_limit']"))
