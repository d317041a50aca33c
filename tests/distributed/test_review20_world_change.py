"""A distributed ``Runner`` whose process group is gone at ``fit()`` (one process, no launch).

A ``Runner`` built under ``torch.distributed`` fixes each rank's share (``global_batch / world``)
and the ranks it votes and all-reduces with. After ``destroy_process_group()`` between two
``fit()`` calls, each rank went on alone: no sync point, no all-reduce, each of its batches
trained as a whole global batch with only a batch-size warning, and the ranks' weights came
apart silently (seen on 2 gloo ranks under torchrun, by hand). Now ``fit()`` raises one
``ValueError`` naming the fix before any step (``autobatch.dist.joining.check_same_world``).
Here the job of 2 ranks the runner was built in is simulated: no second process is needed to
see that it is gone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import Runner
from autobatch.dist import agreement

from runner_workloads import FEATURES, make_data, mse


def test_fit_after_the_process_group_is_gone_is_one_clear_error(monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1).double()
    with monkeypatch.context() as built_in_two_ranks:  # Runner(...) as under a group of 2 ranks
        built_in_two_ranks.setattr(agreement, "world_size", lambda: 2)
        built_in_two_ranks.setattr(agreement, "is_distributed", lambda: True)
        runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=4,
                        grow_after=None, progress=False, log_every=None)
    assert runner.distributed and runner.share == 8
    before = [p.detach().clone() for p in model.parameters()]
    data = [(x[:8], y[:8]) for x, y, _ in make_data(32, 16)]  # this rank's shares, as under the group
    with pytest.raises(ValueError, match=r"built in a job of 2 ranks and fit\(\) now runs in one process .*"
                                         r"destroy_process_group\(\).*build a new Runner"):
        runner.fit(data)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # before: trained alone
