"""``Runner(..., memory_limit="2GiB")``, the budget as find_max_batch and plan() spell it, was
refused with "unexpected keyword argument 'memory_limit'; it takes model, optimizer, ..." (29
names, none of them the place it goes); it now names ``plan_options`` and the call to write."""

import pytest
import torch

import autobatch


@pytest.mark.parametrize("key, value", [("memory_limit", "2GiB"), ("strategy", "binary")])
def test_a_plan_keyword_given_to_the_runner_names_plan_options(key, value):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=rf"Runner\(\) got an unexpected keyword argument '{key}'; it goes inside "
                                        rf"plan_options: pass plan_options=\{{'{key}': '{value}'\}}"):
        autobatch.Runner(model, optimizer, lambda m, b: m(b).sum(), global_batch=8, **{key: value})
