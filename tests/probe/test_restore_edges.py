"""The probe's restore where forward changes the model's layout, where one of its stages fails,
and for the further objects a plain callable's step advances (an LR scheduler, a GradScaler)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import TrainStep, find_max_batch


class LazyMask(torch.nn.Module):
    """Registers a buffer on its first forward (a cached mask or table)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.ones(16), persistent=False)
        return self.linear(x) * self.scale


class GrowingCache(torch.nn.Module):
    """Makes its buffer again, larger, when a larger batch comes (a rotary cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("table", torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16), persistent=False)

    def forward(self, x):
        if x.shape[0] > self.table.shape[0]:
            self.table = torch.zeros(x.shape[0], 16, dtype=torch.float64)
        return self.linear(x) + self.table[: x.shape[0]].float()


class ExpandedBuffer(torch.nn.Module):
    """Swaps its buffer for an expanded view, which no copy can be written into."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.register_buffer("offset", torch.zeros(16))

    def forward(self, x):
        self.offset = torch.zeros(1).expand(16)
        return self.linear(x) + self.offset


def _optimizer(model, kind):
    if kind == "adamw (fresh)":  # steps at learning rate 0: nothing of the weights is copied
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "adamw (has state)":  # copied in the background
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.linear(torch.randn(2, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return optimizer
    return torch.optim.Adagrad(model.parameters(), lr=1e-2)


def _step(model, optimizer):
    return TrainStep(model, optimizer, lambda m, b: m(b).pow(2).mean(), lambda n: torch.randn(n, 16))


def _state(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: (v.copy() if isinstance(v, dict) else v) for k, v in optimizer.state_dict().items()})


@pytest.mark.parametrize("kind", ["adamw (fresh)", "adamw (has state)", "adagrad"])
def test_a_buffer_forward_registered_is_removed_again(kind):
    """Before: KeyError 'scale' from the restore (the copy paths); at lr 0 the buffer stayed."""
    torch.manual_seed(0)
    model = LazyMask()
    optimizer = _optimizer(model, kind)
    before = _state(model, optimizer)
    result = find_max_batch(_step(model, optimizer), memory_limit="2MiB", cache=False, strategy="binary")
    assert result.batch_size > 8
    assert "scale" not in model._buffers and not hasattr(model, "scale")
    after = _state(model, optimizer)
    assert before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert optimizer.param_groups[0]["lr"] == before[1]["param_groups"][0]["lr"]


@pytest.mark.parametrize("kind", ["adamw (fresh)", "adamw (has state)", "adagrad"])
def test_a_buffer_forward_made_again_at_another_size_gets_the_saved_one_back(kind):
    """Before: 'The size of tensor a (...) must match the size of tensor b (8)' from the restore."""
    torch.manual_seed(0)
    model = GrowingCache()
    optimizer = _optimizer(model, kind)
    table = model.table.clone()
    find_max_batch(_step(model, optimizer), memory_limit="2MiB", cache=False, strategy="binary")
    assert model.table.dtype == table.dtype and torch.equal(model.table, table)
    assert model._buffers["table"] is model.table and "table" in model._non_persistent_buffers_set
    model.table.add_(1)  # a fresh tensor of the model's own, not the snapshot's
    assert model(torch.randn(4, 16)).shape == (4, 16)


def test_a_stage_that_fails_leaves_the_rest_restored_and_raises():
    """A buffer the snapshot cannot be written into fails its stage; the learning rate (0 during
    the trials), the optimizer state the trials made and the random generators still come back.
    Before: the restore stopped there, leaving lr 0.0, the trials' Adam state and the RNG."""
    torch.manual_seed(0)
    model = ExpandedBuffer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="single memory location"):
        find_max_batch(_step(model, optimizer), memory_limit="2MiB", cache=False, strategy="binary")
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert len(optimizer.state) == 0
    assert torch.equal(torch.get_rng_state(), rng)


def _linear_and_adamw():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_an_lr_scheduler_given_in_restore_is_put_back():
    """A plain callable stepping a warm-up schedule: the probe's steps no longer advance it."""
    model, optimizer = _linear_and_adamw()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))

    def train_step(n):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(n, 32)), torch.randint(0, 4, (n,))).backward()
        optimizer.step()
        scheduler.step()

    before = scheduler.state_dict()
    result = find_max_batch(train_step, memory_limit="2MiB", restore=(model, optimizer, scheduler), cache=False)
    assert sum(t.steps for t in result.trials) > 3
    assert scheduler.last_epoch == 0 and scheduler.state_dict() == before
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)
    train_step(8)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-5)  # the schedule's second step, as without a probe


def test_a_grad_scaler_given_in_restore_is_put_back():
    model, optimizer = _linear_and_adamw()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def train_step(n):
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(torch.randn(n, 32)), torch.randint(0, 4, (n,)))).backward()
        scaler.step(optimizer)
        scaler.update(new_scale=scaler.get_scale() / 2)  # as steps whose gradients overflow move it

    find_max_batch(train_step, memory_limit="2MiB", restore=(model, optimizer, scaler), cache=False, strategy="binary")
    assert scaler.get_scale() == 1024.0


@pytest.mark.parametrize("item", [5, "scheduler", object()])
def test_a_further_restore_item_without_a_state_dict_is_one_error(item):
    model, optimizer = _linear_and_adamw()
    with pytest.raises(TypeError, match=r"restore\[2\] must have state_dict\(\) and load_state_dict\(\)") as caught:
        find_max_batch(lambda n: None, restore=(model, optimizer, item), memory_limit="1MiB", cache=False)
    assert "\n" not in str(caught.value)
    with pytest.raises(TypeError, match=r"restore must be a \(model, optimizer\) pair"):
        find_max_batch(lambda n: None, restore=(model,), memory_limit="1MiB", cache=False)


def test_the_snapshot_of_a_plain_step_restores_the_scheduler_with_keep():
    """Snapshot.take(others=...) is what find_max_batch uses; restore(keep=True) may come twice."""
    model, optimizer = _linear_and_adamw()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    snapshot = autobatch.probe.snapshot.restore.Snapshot.take(model, optimizer, others=(scheduler,))
    for _ in range(2):
        optimizer.step()
        scheduler.step()
        snapshot.restore(keep=True)
        assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1e-3
    snapshot.restore()


class ClearsCache(torch.nn.Module):
    """Forward clears a registered buffer (``self.cache = None``) or deletes it."""

    def __init__(self, delete: bool) -> None:
        super().__init__()
        self.lin, self.delete = torch.nn.Linear(8, 8), delete
        self.register_buffer("cache", torch.arange(4.0))

    def forward(self, x):
        if self.delete:
            self._buffers.pop("cache", None)
        else:
            self.cache = None
        return self.lin(x)


@pytest.mark.parametrize("delete", [False, True])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad])  # learning rate 0, copies
def test_a_buffer_forward_cleared_is_put_back(delete, optimizer):
    torch.manual_seed(0)
    model = ClearsCache(delete)
    step = TrainStep(model, optimizer(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                     lambda n: torch.randn(n, 8))
    find_max_batch(step, strategy="binary", max_batch=16, memory_limit="64MiB", cache=False)
    assert torch.equal(dict(model.named_buffers())["cache"], torch.arange(4.0))
