"""Runner arguments of the wrong kind are one error naming the argument, when the runner is made:
a string switch (``balanced="no"``, from a config) read as True, a list for ``faults`` failed at
the first step with "'list' object is not callable", ``scheduler=optimizer`` stepped the
optimizer twice a step, and an unknown ``plan_options`` key failed after the first batch loaded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import Runner


@pytest.mark.parametrize(("option", "error", "named"), [
    ({"balanced": "no"}, TypeError, "pass balanced=False"),
    ({"distributed": "false"}, TypeError, "pass distributed=False"),
    ({"checkpointing_fallback": "yes"}, TypeError, "pass checkpointing_fallback=True"),
    ({"progress": "off"}, TypeError, "pass progress=False"),
    ({"log_every": -5}, ValueError, "log_every must be"),
    ({"faults": [(0, "forward")]}, TypeError, "faults must be a callable FaultInjector"),
    ({"no_sync": True}, TypeError, "no_sync must be a callable"),
    ({"scheduler": "optimizer"}, TypeError, "got the optimizer SGD"),
    ({"plan_options": [("memory_limit", 1)]}, TypeError, "plan_options must be a dict"),
    ({"plan_options": {"memory_limt": "1MiB"}}, TypeError, r"plan_options\['memory_limt'\] is no keyword.*memory_limit"),
    ({"plan_options": {"global_batch": 8}}, ValueError, r"Runner\(global_batch=...\)"),
])
def test_a_wrong_kind_of_argument_is_one_error_naming_it(option, error, named):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if option.get("scheduler") == "optimizer":
        option = {"scheduler": optimizer}
    with pytest.raises(error, match=named):
        Runner(model, optimizer, lambda m, b: m(b).mean(), global_batch=8, micro_batch=None, **option)
