"""A TrainStep's probe with a fresh optimizer steps at learning rate 0 instead of copying its
weights (autobatch.probe.snapshot.restore): the weights stay exact, the state and learning rates come
back, and the trials measure the same memory as with the copy."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import autobatch
from autobatch import find_max_batch
from autobatch.probe.snapshot import restore
from autobatch.probe.snapshot.restore import Snapshot, steps_in_place_at_zero_lr

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adam-amsgrad-wd": lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5),
    "adamw-single-tensor": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=False),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.1, weight_decay=0.1),
    "nadam-decoupled": lambda p: torch.optim.NAdam(p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.1, weight_decay=0.1),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9, centered=True, weight_decay=0.1),
}


def _step(optimizer=OPTIMIZERS["adamw"], loss_scale: float = 1.0, seed: int = 0) -> autobatch.TrainStep:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(), torch.nn.Linear(128, 4))

    def loss_fn(m, batch):
        return m(batch).square().mean() * loss_scale

    return autobatch.TrainStep(model, optimizer(model.parameters()), loss_fn, lambda n: torch.randn(max(n, 2), 32))


def _weights(step):
    return {name: tensor.clone() for name, tensor in step.model.state_dict().items()}


def _assert_same(before, after):
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
        assert torch.equal(before[name].signbit(), after[name].signbit()), name


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_probe_at_learning_rate_zero_leaves_the_model_and_optimizer_as_they_were(name):
    step = _step(OPTIMIZERS[name])
    assert steps_in_place_at_zero_lr(step.optimizer)
    before, groups = _weights(step), copy.deepcopy(step.optimizer.state_dict()["param_groups"])
    result = find_max_batch(step, memory_limit="6MiB", steps_per_trial=2, cache=False)
    assert result.num_trials >= 3
    _assert_same(before, _weights(step))  # BatchNorm's statistics included: those are copied
    assert not step.optimizer.state and step.optimizer.state_dict()["param_groups"] == groups
    assert not step.optimizer._optimizer_step_pre_hooks

    twin = _step(OPTIMIZERS[name])  # never probed: training from here is the same, step for step
    for trained in (step, twin):
        torch.manual_seed(1)
        for _ in range(3):
            trained(16)
    _assert_same(_weights(twin), _weights(step))


def test_the_trials_measure_what_they_measure_with_the_copy(monkeypatch):
    in_place = find_max_batch(_step(), memory_limit="6MiB", steps_per_trial=2, cache=False)
    monkeypatch.setattr(restore, "steps_in_place_at_zero_lr", lambda optimizer: False)
    copied = find_max_batch(_step(), memory_limit="6MiB", steps_per_trial=2, cache=False)
    assert in_place.batch_size == copied.batch_size
    assert [(t.batch_size, t.passed, t.peak_bytes) for t in in_place.trials] == \
        [(t.batch_size, t.passed, t.peak_bytes) for t in copied.trials]


def test_non_finite_gradients_cannot_reach_the_weights():
    step = _step(loss_scale=float("nan"))
    before = _weights(step)
    snapshot = Snapshot.take(step.model, step.optimizer, background=True, zero_lr=True)
    assert snapshot.weights_in_place
    step(8)  # every gradient NaN: zeroed before the step, so 0 * update leaves the weights
    for name, param in step.model.named_parameters():
        assert torch.equal(param, before[name]), name
    snapshot.restore()
    _assert_same(before, _weights(step))


def _with_negative_zero(step):
    with torch.no_grad():
        step.model[0].weight[0, 0] = -0.0
    return step


def _with_nan(step):
    with torch.no_grad():
        step.model[3].bias[0] = float("nan")
    return step


def _with_inf(step):
    with torch.no_grad():
        step.model[0].weight[2, 3] = float("-inf")
    return step


def _with_bf16_negative_zero(step):
    step.model.to(torch.bfloat16)
    make = step.make_batch
    step.make_batch = lambda n: make(n).bfloat16()
    with torch.no_grad():
        step.model[3].weight[1, 5] = -0.0
    return step


def _stepped(step):
    step(4)
    return step


def _tensor_lr(step):
    step.optimizer.param_groups[0]["lr"] = torch.tensor(0.1)
    return step


class _MyAdamW(torch.optim.AdamW):
    """A subclass may step otherwise (a learning rate it does not scale by)."""


@pytest.mark.parametrize("make", [
    lambda: _stepped(_step()),  # Adam's moments exist: a step would change them
    lambda: _with_negative_zero(_step()),
    lambda: _with_nan(_step()),
    lambda: _with_inf(_step()),
    lambda: _with_bf16_negative_zero(_step()),
    lambda: _tensor_lr(_step()),
    lambda: _step(lambda p: _MyAdamW(p, lr=0.1)),
    lambda: _step(lambda p: torch.optim.Adagrad(p, lr=0.1)),  # builds its state at construction
    lambda: _step(lambda p: torch.optim.Rprop(p, lr=0.1)),  # its step sizes are not scaled by lr
], ids=["state", "negative-zero", "nan-weight", "inf-weight", "bf16-negative-zero", "tensor-lr", "subclass", "adagrad", "rprop"])
def test_whatever_a_zero_step_could_change_is_copied_instead(make):
    step = make()
    assert not steps_in_place_at_zero_lr(step.optimizer)
    before = _weights(step)
    lrs = [group["lr"] for group in step.optimizer.param_groups]
    snapshot = Snapshot.take(step.model, step.optimizer, background=True, zero_lr=True)
    assert not snapshot.weights_in_place and [group["lr"] for group in step.optimizer.param_groups] == lrs
    step(8)
    snapshot.restore()
    after = _weights(step)
    for name in before:  # NaN where the weight was NaN: compared bit for bit
        kind = torch.int16 if before[name].dtype == torch.bfloat16 else torch.int32
        assert torch.equal(before[name].view(-1).view(kind), after[name].view(-1).view(kind)), name


def test_the_planner_times_candidates_at_learning_rate_zero_and_gives_each_a_fresh_optimizer():
    from autobatch.planning.throughput import Candidate, measure_candidates

    step = _step()
    before, lr = _weights(step), step.optimizer.param_groups[0]["lr"]
    states_seen = []
    real = step.optimizer_step

    def optimizer_step():  # each candidate starts with no optimizer state, at learning rate 0
        states_seen.append((len(step.optimizer.state), step.optimizer.param_groups[0]["lr"]))
        real()

    step.optimizer_step = optimizer_step
    candidates = [Candidate.build(16, m, False) for m in (4, 8, 16)]
    # a clock whose every step takes one tick: no candidate is pruned as slower than the best
    measure_candidates(step, candidates, global_batch=16, warmup_steps=0, timed_steps=2, rounds=2,
                       timer=itertools.count().__next__)
    assert all(c.error is None for c in candidates) and len(states_seen) == 12
    assert states_seen[::2] == [(0, 0.0)] * 6 and all(lr_seen == 0.0 for _, lr_seen in states_seen)
    _assert_same(before, _weights(step))
    assert not step.optimizer.state and step.optimizer.param_groups[0]["lr"] == lr
    assert not step.optimizer._optimizer_step_pre_hooks


def test_weights_of_mixed_float_types_are_checked_each_in_its_own_type():
    step = _step()
    step.model[0].double()  # float64 beside float32: one fused norm per type (a norm asked for float32 fails on float64)
    make = step.make_batch
    step.make_batch = lambda n: make(n).double()
    step.model[1].double()
    step.model.insert(3, _ToFloat())
    assert steps_in_place_at_zero_lr(step.optimizer)
    with torch.no_grad():
        step.model[0].weight[1, 1] = -0.0  # a float64 negative zero is spotted too
    assert not steps_in_place_at_zero_lr(step.optimizer)


class _ToFloat(torch.nn.Module):
    def forward(self, x):
        return x.float()


def test_an_empty_parameter_does_not_stop_the_check():
    step = _step()
    step.model.register_parameter("empty", torch.nn.Parameter(torch.empty(0)))
    step.optimizer.add_param_group({"params": [step.model.empty]})
    assert steps_in_place_at_zero_lr(step.optimizer)


def test_huge_gradients_leave_the_weights_exact_at_learning_rate_zero():
    step = _step(loss_scale=1e38)  # squares overflow: Adam's second moment would be inf
    before = _weights(step)
    snapshot = Snapshot.take(step.model, step.optimizer, zero_lr=True)
    step(8)
    step(8)
    for name, param in step.model.named_parameters():
        assert torch.equal(param, before[name]) and torch.equal(param.signbit(), before[name].signbit()), name
    snapshot.restore()
    _assert_same(before, _weights(step))


class _Renormed(torch.nn.Module):
    """Forward renorms the embedding rows it looks up (``max_norm``), in place."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(200, 16, max_norm=1.0)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


class _Codebook(torch.nn.Module):
    """A vector quantizer's codebook: a parameter no optimizer holds, moved by forward."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(32, 16), requires_grad=False)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        with torch.no_grad():
            self.embed.mul_(0.99).add_(0.01 * h.mean(0))
        return h @ self.embed.t()


WRITERS = {  # model, its optimizer (zero_lr: AdamW; the background copy: Adagrad), batch
    "max_norm-zero-lr": (_Renormed, lambda m: torch.optim.AdamW(m.parameters()), lambda n: torch.randint(0, 200, (n, 8))),
    "max_norm-background": (_Renormed, lambda m: torch.optim.Adagrad(m.parameters()), lambda n: torch.randint(0, 200, (n, 8))),
    "codebook-zero-lr": (_Codebook, lambda m: torch.optim.AdamW(m.proj.parameters()), lambda n: torch.randn(n, 16)),
    "codebook-background": (_Codebook, lambda m: torch.optim.Adagrad(m.proj.parameters()), lambda n: torch.randn(n, 16)),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_parameters_forward_writes_are_copied_before_the_first_trial(name):
    """Neither a step at learning rate 0 nor a copy that waits for the optimizer protects a
    parameter forward writes: those are copied at once, and the model comes back exact."""
    make_model, make_optimizer, make_batch = WRITERS[name]
    torch.manual_seed(0)
    model = make_model()
    step = autobatch.TrainStep(model, make_optimizer(model), lambda m, b: m(b).square().mean(), make_batch)
    before = _weights(step)
    find_max_batch(step, memory_limit="4MiB", steps_per_trial=2, cache=False)
    _assert_same(before, _weights(step))


def test_a_frozen_backbone_of_torch_modules_is_left_to_the_optimizer_path():
    """Only what may be written is copied at once: torch.nn's modules write no parameter of
    their own in forward (but ``max_norm``), so a frozen backbone costs no copy."""
    backbone = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Embedding(4, 8), torch.nn.Embedding(4, 8, max_norm=1.0))
    backbone.requires_grad_(False)
    head = torch.nn.Linear(8, 1)
    written = restore.written_outside_the_optimizer(torch.nn.ModuleList([backbone, head]), torch.optim.SGD(head.parameters(), lr=1))
    assert written == {id(backbone[2].weight)}


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov-wd"])
def test_the_optimizers_groups_are_the_same_objects_after_a_probe(name):
    step = _step(OPTIMIZERS[name])
    groups, first = step.optimizer.param_groups, step.optimizer.param_groups[0]
    find_max_batch(step, memory_limit="6MiB", steps_per_trial=2, cache=False)
    assert step.optimizer.param_groups is groups and groups[0] is first
    first["lr"] = 0.25  # a warm-up writing through the group it holds reaches the optimizer
    assert step.optimizer.state_dict()["param_groups"][0]["lr"] == 0.25
