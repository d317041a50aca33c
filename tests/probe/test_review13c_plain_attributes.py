"""Tensors a forward keeps as plain module attributes (``self.mask = ...``, not a buffer) are put
back by the probe's restore, after the probe and between trials (review 13c): a mask a failed
trial made was held through the trials below it, and stayed on the model after the probe."""

from __future__ import annotations

import torch

import autobatch
from autobatch import TrainStep
from autobatch.probe.snapshot.restore import Snapshot


class Cached(torch.nn.Module):
    """Keeps what a forward computes in plain attributes: a mask grown to the largest batch seen,
    a dict of tables by size, a counter written in place, a slot that held None."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.tables: dict[int, torch.Tensor] = {}
        self.calls = torch.zeros(())  # a statistic not registered as a buffer
        self.last = None
        self.weight_alias = self.linear.weight  # the same object as a parameter
        self.shared = torch.arange(4.0)

    def forward(self, x):
        n = x.shape[0]
        if getattr(self, "mask", None) is None or self.mask.shape[0] < n:
            self.mask = torch.ones(n, 256)  # 1 KiB a sample, kept after the step
        self.tables[n] = torch.zeros(n, 4)
        self.calls += 1
        self.last = x.detach()
        self.shared = self.shared * 2  # replaced: a new object
        return self.linear(x) * self.mask[:n, :16]


def _step(model):
    optimizer = torch.optim.AdamW(model.parameters())
    return TrainStep(model, optimizer, lambda m, b: m(b).pow(2).mean(), lambda n: torch.randn(n, 16))


def test_the_probe_leaves_no_tensor_forward_kept_and_puts_back_those_it_replaced():
    torch.manual_seed(0)
    model = Cached()
    tables, shared, calls = model.tables, model.shared, model.calls
    autobatch.find_max_batch(_step(model), memory_limit="1MiB", cache=False, estimate_first=False)
    assert not hasattr(model, "mask")  # before: the last trial's mask stayed on the model
    assert model.tables is tables and tables == {}  # the dict the trials filled is empty again
    assert model.calls is calls and model.calls.item() == 0  # written in place: its value back
    assert model.last is None and model.weight_alias is model.linear.weight
    assert torch.equal(model.shared, torch.arange(4.0)) and model.shared is shared  # still held here: the same object


def test_a_replaced_tensor_gets_one_copy_for_every_place_that_shared_it():
    model, other = Cached(), torch.nn.Module()
    other.shared = model.shared
    holder = torch.nn.ModuleList([model, other])
    snapshot = Snapshot.take(holder)
    original = model.shared
    model.shared, other.shared = torch.ones(4), torch.ones(4)
    del original  # only the snapshot's weak reference is left: the values come back as a copy
    snapshot.restore()
    assert model.shared is other.shared and torch.equal(model.shared, torch.arange(4.0))


def test_between_trials_the_memory_a_larger_trial_kept_is_released():
    """``undo_forward`` (what a trial starts with) drops the mask, so a smaller trial after a
    failed larger one runs as a fresh process does, and the budget counts nothing of it."""
    model = Cached()
    step = _step(model)
    with autobatch.simulated_memory("64MiB") as budget:
        snapshot = Snapshot.take(model, step.optimizer)
        held = budget.current_bytes
        with torch.no_grad():
            model(torch.randn(4096, 16))
        assert budget.current_bytes - held >= 4096 * 1024  # the mask of the larger batch
        snapshot.undo_forward()
        assert budget.current_bytes - held < 64 * 1024 and not hasattr(model, "mask")
        snapshot.restore()


def test_a_tensor_counted_by_an_enclosing_budget_is_counted_again_after_the_probe():
    with autobatch.simulated_memory("64MiB") as budget:
        model = Cached()  # made inside the block: its plain tensors are device memory
        before = budget.current_bytes
        autobatch.find_max_batch(_step(model), cache=False, max_batch=64)
        assert torch.equal(model.shared, torch.arange(4.0))
        assert budget.current_bytes == before
