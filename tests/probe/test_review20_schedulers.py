"""An LR scheduler in ``restore`` is put back between trials too (``Snapshot.undo_forward``): the
trials' steps added up, and a ``OneCycleLR`` three steps short of its ``total_steps`` raised
"Tried to step 11 times" from the probe's trials, under a note blaming batch sizes the step
refuses (found by the plain-loop round)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autobatch


def test_a_one_cycle_schedule_near_its_end_survives_the_probes_trials():
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)

    def step(batch_size):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(batch_size, 16)), torch.randint(0, 4, (batch_size,))).backward()
        optimizer.step()
        schedule.step()

    for _ in range(3):
        step(4)
    before = schedule.state_dict()
    result = autobatch.find_max_batch(step, memory_limit="256KiB", steps_per_trial=2, strategy="binary",
                                      restore=(model, optimizer, schedule))
    assert len(result.trials) * 2 > 10 - 3  # more steps in all than the schedule had left
    assert schedule.state_dict() == before
