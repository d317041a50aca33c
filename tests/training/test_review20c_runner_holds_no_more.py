"""The probe's answer trains in the ``Runner`` under the same budget (issue 16's CPU line): the
simulated device's answers fill the budget to the byte, so the runner's step may hold nothing a
trial does not. With an fp16 ``GradScaler`` on the CPU it held a copy of the scale through each
step, the skip count kept into the next and the step guard's copies of the scaler's two scalars
(20 bytes over the trial's peak: its second step ran out of memory at the answer and recovered
below it); from a ``DataLoader`` drawn inside the budget, the whole global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autobatch
from autobatch.memory.simulated import host_memory
from autobatch.planning.accumulation import AccumulatingStep


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def make(n):
    return torch.randn(n, 16), torch.randint(0, 10, (n,))


@pytest.mark.parametrize(("pieces", "options"), [
    (1, {}),
    (1, {"max_grad_norm": 1.0, "autocast_dtype": torch.bfloat16}),
    (3, {"max_grad_norm": 1.0}),
])
def built(pieces, options, scaled=True):
    """A model, its optimizer and scaler, and its probe step (made afresh: no state counted outside a budget)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    step = autobatch.TrainStep(model, optimizer, loss_fn, make, grad_scaler=scaler, **options)
    return model, optimizer, scaler, AccumulatingStep(step) if pieces > 1 else step


@pytest.mark.parametrize(("pieces", "options"), [
    (1, {}),
    (1, {"max_grad_norm": 1.0, "autocast_dtype": torch.bfloat16}),
    (3, {"max_grad_norm": 1.0}),
])
def test_a_grad_scaler_answer_trains_in_the_runner_under_a_budget_it_fills_to_the_byte(pieces, options):
    *_, step = built(pieces, options)
    with autobatch.simulated_memory("1GiB") as device:  # the trial's steady peak at 300 is the budget
        for _ in range(2):
            device.reset_peak()
            step(300)
        budget = device.peak_bytes
    answer = autobatch.find_max_batch(built(pieces, options)[-1], memory_limit=budget, cache=False).batch_size
    assert answer == 300
    model, optimizer, scaler, _ = built(pieces, options)  # as a new process: the scaler's scalars made in the budget
    with autobatch.simulated_memory(budget) as device:
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=pieces * answer, micro_batch=answer,
                                  progress=False, grad_scaler=scaler, **options)
        with host_memory():
            data = [make(pieces * answer) for _ in range(3)]
        result = runner.fit(data)
    assert result.steps == 3 and result.oom_recoveries == [] and device.oom_count == 0


@pytest.mark.parametrize("pieces", [1, 2])
def test_a_data_loaders_batches_are_host_memory_under_a_simulated_budget(pieces):
    """A ``DataLoader`` drawn inside ``simulated_memory`` collated each global batch in the budget,
    and the runner's move of a micro-batch made no copy of it: the whole batch's inputs stayed
    alive through every backward, beyond the trial's one micro-batch, and the runner's first step
    ran out of memory at a size whose trial filled the budget (its batches are now drawn as host
    memory, as the command line's loader already was)."""
    from torch.utils.data import DataLoader, TensorDataset

    *_, step = built(pieces, {}, scaled=False)
    with autobatch.simulated_memory("1GiB") as device:
        for _ in range(2):
            device.reset_peak()
            step(300)
        budget = device.peak_bytes
    model, optimizer, *_ = built(pieces, {}, scaled=False)
    inputs, labels = make(2 * pieces * 300)
    with autobatch.simulated_memory(budget) as device:
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=pieces * 300, micro_batch=300, progress=False)
        result = runner.fit(DataLoader(TensorDataset(inputs, labels), batch_size=pieces * 300, shuffle=True))
    assert result.steps == 2 and result.oom_recoveries == [] and device.oom_count == 0
