"""Review of planning (ninth pass): checkpointing of nested containers, plan()'s argument
checks on every path, and the throughput timing leaving a grad scaler as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from autobatch import TrainStep, enable_checkpointing, plan
from autobatch.planning.checkpointing import find_blocks


def saved_tensors(model: nn.Module, x: torch.Tensor) -> int:
    """How many tensors autograd saves for backward in one forward of ``model``."""
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    out.sum().backward()
    return count


class Stages(nn.Module):
    """A U-Net-like model: a ModuleList of stages, each a ModuleList of repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(2))
            for _ in range(3)
        )

    def forward(self, x):
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x


def test_a_modulelist_of_modulelists_checkpoints_the_blocks_that_are_called():
    """An inner ModuleList has no forward, so it is never called: wrapping it checkpointed
    nothing (as many tensors saved as without), while the handle named three blocks."""
    model = Stages()
    x = torch.randn(4, 8)
    plain = copy.deepcopy(model)
    saved_plain = saved_tensors(plain, x)
    handle = enable_checkpointing(model)
    assert handle.modules == [f"stages.{i}.{j}" for i in range(3) for j in range(2)]
    assert saved_tensors(model, x) < saved_plain
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    handle.undo()
    assert saved_tensors(model, x) == saved_plain


def test_a_modulelist_of_moduledicts_is_no_block():
    """Repeated ModuleDicts are never called either: their layers are searched (single torch.nn
    layers, no block), so nothing is named as checkpointed."""

    class Dicts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block["b"](torch.tanh(block["a"](x)))
            return x

    assert find_blocks(Dicts()) == []


def small_step(**options) -> TrainStep:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3), lambda m, x: m(x).pow(2).mean(),
                     lambda b: torch.randn(b, 16), **options)


@pytest.mark.parametrize("steps_per_trial", [0, -1, None, True, "3", 2.0])
@pytest.mark.parametrize("global_batch", [30, 32])
def test_a_bad_steps_per_trial_is_one_error_on_every_path(steps_per_trial, global_batch):
    """30 by multiple_of=4 is probed alone in one step, whose trials run at least two steps:
    max(2, steps_per_trial) took 0, -1, True and 2.0 silently and raised a TypeError from max
    for None and a string; 32 (the ordinary path) named steps_per_trial."""
    with pytest.raises(ValueError, match="steps_per_trial must be a positive integer"):
        plan(small_step(), global_batch=global_batch, multiple_of=4, steps_per_trial=steps_per_trial,
             memory_limit="64MiB", cache=False)


def test_throughput_timing_leaves_the_grad_scaler_as_it_was():
    """The timed candidates step the grad scaler (its scale grows every growth_interval steps);
    the probe put it back, the candidates' timing did not: plan() returned with the scale at
    128 times the user's."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    before = scaler.state_dict()
    step = small_step(grad_scaler=scaler)
    result = plan(step, global_batch=40, memory_limit=20 * 1024, cache=False, steps_per_trial=1,
                  objective="throughput", timed_steps=2)
    assert len(result.candidates) > 1
    assert scaler.state_dict() == before


def test_a_batch_below_min_micro_batch_too_large_for_one_piece_says_so():
    """5 samples, micro-batches of at most 2, none below 8: one piece of 5, above 3. The error
    said "1 of 8 leave -3 over"."""
    from autobatch.planning.accumulation import micro_batch_sizes

    assert micro_batch_sizes(5, 4, min_micro_batch=8) == [5]
    with pytest.raises(ValueError, match="min_micro_batch=8") as error:
        micro_batch_sizes(5, 2, min_micro_batch=8)
    assert "-3" not in str(error.value) and "one piece of 5" in str(error.value)
