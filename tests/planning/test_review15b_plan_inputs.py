"""plan()'s inputs a user gets wrong: each one error naming plan() and what to change, before any probe.

A misspelt ``**probe_kwargs`` key (``memory_limt``) failed inside the first probe as
``find_max_batch() got an unexpected keyword argument``, naming neither ``plan()`` nor the
name meant; ``timer="..."`` failed as ``'str' object is not callable`` after every probe had
run; ``Plan.from_dict`` of a JSON string raised ``'str' object has no attribute 'items'``, and
took a plan whose micro-batch sizes did not make its global batch.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autobatch import Plan, TrainStep, plan


def untouched_step() -> TrainStep:
    """A step whose batches must never be built: the errors come before any probe."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def make_batch(n):
        raise AssertionError("a probe ran before the bad argument was reported")

    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), make_batch)


def test_an_unknown_keyword_names_plan_and_the_closest_name_before_any_probe():
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'memory_limt'.*"
                                        r"did you mean 'memory_limit'\?.*steps_per_trial"):
        plan(untouched_step(), global_batch=8, memory_limt="1MiB")
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'fn'"):  # the step is positional
        plan(untouched_step(), global_batch=8, fn=print)


@pytest.mark.parametrize("name", ["timer", "allocator_retries"])
def test_timing_hooks_that_are_not_callables_are_refused_before_any_probe(name):
    with pytest.raises(TypeError, match=f"{name} must be a callable"):
        plan(untouched_step(), global_batch=8, objective="throughput", **{name: "perf_counter"})


def test_from_dict_names_what_to_pass():
    saved = Plan(global_batch=8, micro_batch=3, accumulation_steps=3, micro_batch_sizes=[3, 3, 2],
                 checkpointing=False).to_dict()
    assert Plan.from_dict({**saved, "command": "train"}) == Plan.from_dict(json.loads(json.dumps(saved)))
    with pytest.raises(TypeError, match=r"got str \(JSON text: pass json.loads\(text\)\)"):
        Plan.from_dict(json.dumps(saved))
    with pytest.raises(ValueError, match="lacks micro_batch, accumulation_steps, micro_batch_sizes, checkpointing"):
        Plan.from_dict({"global_batch": 8})
    with pytest.raises(ValueError, match=r"micro_batch_sizes \[3, 3, 2\] \(sum 8\) do not make global_batch=16"):
        Plan.from_dict({**saved, "global_batch": 16})  # an edited plan would train another global batch
