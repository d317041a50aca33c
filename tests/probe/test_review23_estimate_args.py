"""The estimates spell the memory budget as find_max_batch does: ``estimate_max_batch(step,
memory_limit="16GiB")`` failed with Python's bare "unexpected keyword argument" (its parameter is
``capacity``); it is now taken as ``capacity``, both at once is one error, and a keyword the
estimates do not take names the closest one they do."""

import pytest

import autobatch
from autobatch.probe.tracing.estimate import estimate_max_batch, estimate_peak

from workloads import make_mlp_step


def test_memory_limit_is_the_capacity():
    step = make_mlp_step(width=8, in_features=4)
    spelled = estimate_max_batch(step, memory_limit="1MiB", max_batch=8)
    assert spelled.capacity_bytes == 1 << 20 and 0 < spelled.batch_size <= 8


@pytest.mark.parametrize("positional", [True, False])
def test_both_names_of_the_budget_are_one_error(positional):
    step = make_mlp_step(width=16, in_features=8)
    given = (("1MiB",), {}) if positional else ((), {"capacity": "1MiB"})
    with pytest.raises(TypeError, match="got both capacity and memory_limit.*pass one"):
        estimate_max_batch(step, *given[0], memory_limit="2MiB", **given[1])


def test_a_peer_keyword_names_the_estimates_own():
    step = make_mlp_step(width=16, in_features=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_batch_size'; did you mean 'max_batch'"):
        estimate_max_batch(step, "1MiB", max_batch_size=64)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch'; did you mean 'batch_size'"):
        estimate_peak(step, batch=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'capacity'; did you mean 'memory_limit'"):
        autobatch.find_max_batch(step, capacity="1MiB")  # and the other way round: the probe's name
