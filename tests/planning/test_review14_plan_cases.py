"""plan() on cases a user tries next: BatchNorm models split into micro-batches, plans applied
across DDP / torch.compile wrappers, dropout under a checkpointed plan, nothing fitting at a
multiple_of, and planning again on a model an earlier plan wrapped.

BatchNorm in training normalises each micro-batch with its own statistics, so a plan that
splits such a model is not exact: the plan said nothing (its accumulation passed for exact).
A plan made on a wrapped model (DDP's ``module.``) named modules the bare model has not:
``Plan.apply`` raised get_submodule's bare ``AttributeError`` ("Sequential has no attribute
`module`").
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

import autobatch
from autobatch import Plan, TrainStep, plan
from autobatch.planning.batch_statistics import batch_statistics_note
from autobatch.planning.checkpointing import enable_checkpointing, is_checkpointed


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))) + x


def conv_step(model: nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 4, 8, 8))


def test_a_plan_that_splits_batchnorm_says_so(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(ConvBlock(), ConvBlock())
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        split = plan(conv_step(model), global_batch=16, memory_limit="100KiB", steps_per_trial=1,
                     strategy="binary")
    assert split.accumulation_steps > 1
    notes = [note for note in split.notes if "BatchNorm" in note]
    assert len(notes) == 1 and "0.bn: BatchNorm2d" in notes[0] and "one batch of 16" in notes[0]
    assert any("BatchNorm" in record.getMessage() for record in caplog.records)
    # in one step, or in eval mode (running statistics), the split changes nothing: no note
    assert batch_statistics_note(model, [16]) is None
    model.eval()
    assert batch_statistics_note(model, [8, 8]) is None


class FakeDDP(nn.Module):
    """DDP's shape without a process group: the model as ``.module``, and ``no_sync``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield


class Compiled(nn.Module):
    """torch.compile's OptimizedModule holds the model as ``_orig_mod``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, x):
        return self._orig_mod(x)


def blocks() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)) for _ in range(3)))


def checkpointed(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if is_checkpointed(module)]


def saved_plan(modules: list[str]) -> Plan:
    return Plan.from_dict(Plan(global_batch=4, micro_batch=1, accumulation_steps=4, micro_batch_sizes=[1] * 4,
                               checkpointing=True, checkpointed_modules=modules).to_dict())


def test_a_plan_applies_across_wrappers():
    planned_wrapped = saved_plan(["module.0", "module.1", "module.2"])  # planned under DDP
    bare = blocks()
    assert planned_wrapped.apply(bare).modules == ["0", "1", "2"] and checkpointed(bare) == ["0", "1", "2"]
    planned_wrapped.undo()
    assert checkpointed(bare) == []
    planned_bare = saved_plan(["0", "2"])
    wrapped = FakeDDP(Compiled(blocks()))  # DDP around a compiled model
    assert planned_bare.apply(wrapped).modules == ["module._orig_mod.0", "module._orig_mod.2"]
    planned_bare.undo()
    assert checkpointed(wrapped) == []
    # the same names apply as they are
    assert saved_plan(["module.1"]).apply(FakeDDP(blocks())).modules == ["module.1"]


def test_names_the_model_lacks_are_one_clear_error():
    with pytest.raises(ValueError, match=r"\['blocks.0'\] are not modules of the model \(Sequential"):
        saved_plan(["blocks.0"]).apply(blocks())
    model = blocks()
    with pytest.raises(ValueError, match="named_modules"):
        enable_checkpointing(model, modules=["0", "nope"])
    assert checkpointed(model) == []  # nothing half-wrapped


def test_a_checkpointed_plan_replays_dropout_exactly():
    """Checkpointing recomputes with the forward's random state: with dropout, a checkpointed
    plan's gradients are the plain plan's, bit for bit (micro-batches draw other masks than
    one batch would, with or without checkpointing)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.GELU()) for _ in range(3))).double()
    batch = torch.randn(7, 8, dtype=torch.float64)

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model.zero_grad()
        handle = enable_checkpointing(model) if checkpointing else None
        assert checkpointing is bool(handle and handle.modules)
        torch.manual_seed(1)
        autobatch.accumulate_gradients(model, lambda m, x: m(x).pow(2).mean(), batch, 3)
        if handle is not None:
            handle.undo()
        return [p.grad.clone() for p in model.parameters()]

    for plain, wrapped in zip(grads(False), grads(True)):
        assert torch.equal(plain, wrapped)


def test_nothing_fits_at_multiple_of_names_a_smaller_one():
    """multiple_of=8 never tries batch 1 to 7: where not even 8 fits with checkpointing, the
    error named precision, model and memory, but not the multiple_of that kept smaller
    micro-batches from being tried (only the allow_checkpointing=False hint did)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(3)))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 64, 16))
    with pytest.raises(autobatch.NoBatchFitsError, match="checkpointing of 3 blocks") as caught:
        plan(step, global_batch=16, memory_limit="150KiB", multiple_of=8, strategy="binary", steps_per_trial=1)
    assert "a multiple_of below 8 (no smaller micro-batch was tried)" in str(caught.value)
    assert plan(step, global_batch=16, memory_limit="150KiB", strategy="binary", steps_per_trial=1).micro_batch < 8


def test_an_earlier_plans_undo_leaves_a_newer_plans_checkpointing():
    """Planning again on a model an earlier plan wrapped: the new plan wrapped the blocks anew,
    and the earlier plan's undo() unwrapped them, so the new plan (checkpointing=True) trained
    without checkpointing. A plan that does not wrap puts the earlier wrapping back, still the
    earlier plan's to undo."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(3)))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                     lambda n: torch.randn(n, 64, 16))
    tight = dict(memory_limit="150KiB", multiple_of=4, strategy="binary", steps_per_trial=1)
    first = plan(step, global_batch=16, **tight)
    second = plan(step, global_batch=32, **tight)
    assert first.checkpointing and second.checkpointing
    first.undo()
    assert checkpointed(model) == ["0", "1", "2"]  # the newer plan's wrapping stays
    second.undo()
    assert checkpointed(model) == []
    third = plan(step, global_batch=16, **tight)
    roomy = plan(step, global_batch=16, memory_limit="4MiB", strategy="binary", steps_per_trial=1)
    assert third.checkpointing and not roomy.checkpointing and checkpointed(model) == ["0", "1", "2"]
    third.undo()
    assert checkpointed(model) == []
