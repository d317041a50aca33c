"""A notebook user probes a model they already trained for a while (review 26): after the probe
returns, raises a non-OOM error from the loss at a large size, or is interrupted from inside a
trial, everything the user's training holds is as before, bit for bit, and nothing stays allocated
on the simulated device."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import TrainStep, simulated_memory


def _trained():
    """Trained five fp16-scaled Adam steps, a scheduler stepped after each, gradients left by a last
    backward (one None), one BatchNorm in eval mode, a frozen bias, the user's own hooks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 2))
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for _ in range(5):
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,)))).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
    model[6].weight.grad = None
    model[5].eval()
    model[0].register_forward_hook(lambda *_: None)
    model[4].weight.register_hook(lambda grad: grad)
    optimizer.register_step_post_hook(lambda *_: None)
    random.random(), np.random.rand()  # the generators drawn from before the probe
    return model, optimizer, scheduler, scaler


def _state(model, optimizer, scheduler, scaler) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},  # BatchNorm's num_batches_tracked too
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "ids": [id(p) for p in model.parameters()], "held": [id(p) for g in optimizer.param_groups for p in g["params"]],
        "optimizer": repr(optimizer.state_dict()), "lr": [g["lr"] for g in optimizer.param_groups],
        "scheduler": scheduler.state_dict(), "scaler": repr(scaler.state_dict()),
        "modes": [m.training for m in model.modules()], "requires_grad": [p.requires_grad for p in model.parameters()],
        "rng": (torch.get_rng_state(), random.getstate(), repr(np.random.get_state())),
        "hooks": ([len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()],
                  [len(p._backward_hooks or {}) for p in model.parameters()], len(optimizer._optimizer_step_post_hooks),
                  len(optimizer._optimizer_step_pre_hooks), len(torch.nn.modules.module._global_forward_pre_hooks)),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    assert all(torch.equal(before["tensors"][k], after["tensors"][k]) for k in before["tensors"])
    assert [g is None for g in before["grads"]] == [g is None for g in after["grads"]]
    assert all(a is None or torch.equal(a, b) for a, b in zip(before["grads"], after["grads"]))
    assert torch.equal(before["rng"][0], after["rng"][0]) and before["rng"][1:] == after["rng"][1:]
    for key in ("ids", "held", "optimizer", "lr", "scheduler", "scaler", "modes", "requires_grad", "hooks"):
        assert before[key] == after[key], key


def _loss(mode: str):
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if mode == "error" and len(batch[0]) >= 64:
            raise ValueError("a bug in the loss at a large size")
        if mode == "interrupt" and calls[0] == 3:
            raise KeyboardInterrupt
        return F.cross_entropy(model(batch[0]), batch[1])

    return loss_fn


def _batch(n: int):
    return torch.randn(n, 8), torch.randint(0, 2, (n,))


@pytest.mark.parametrize("mode", ["returns", "error", "interrupt"])
def test_a_train_step_probe_leaves_a_trained_model_as_it_was(mode):
    with simulated_memory("1MiB") as device:
        model, optimizer, scheduler, scaler = _trained()
        before = _state(model, optimizer, scheduler, scaler)
        gc.collect()
        held = device.current_bytes
        step = TrainStep(model, optimizer, _loss(mode), _batch, grad_scaler=scaler)
        with pytest.raises((ValueError, KeyboardInterrupt)) if mode != "returns" else _nothing():
            autobatch.find_max_batch(step, cache=False, estimate_first=False)
        del step
        gc.collect()
        assert device.current_bytes == held  # nothing of the trials stays on the device
        _assert_same(before, _state(model, optimizer, scheduler, scaler))


def test_an_interrupted_plain_callable_with_restore_leaves_everything_as_it_was():
    with simulated_memory("1MiB") as device:
        model, optimizer, scheduler, scaler = _trained()
        before = _state(model, optimizer, scheduler, scaler)
        gc.collect()
        held, loss_fn = device.current_bytes, _loss("interrupt")

        def step(batch_size: int) -> None:
            random.random(), np.random.rand()
            optimizer.zero_grad()
            scaler.scale(loss_fn(model, _batch(batch_size))).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

        with pytest.raises(KeyboardInterrupt):
            autobatch.find_max_batch(step, cache=False, restore=(model, optimizer, scheduler, scaler))
        del step
        gc.collect()
        assert device.current_bytes == held
        _assert_same(before, _state(model, optimizer, scheduler, scaler))


def test_probing_twice_gives_the_same_answer_and_a_kept_result_holds_nothing(tmp_path):
    with simulated_memory("1MiB") as device:
        model, optimizer, scheduler, scaler = _trained()
        before = _state(model, optimizer, scheduler, scaler)
        step = TrainStep(model, optimizer, _loss("returns"), _batch, grad_scaler=scaler)
        for cache in (False, tmp_path):
            first = autobatch.find_max_batch(step, cache=cache, estimate_first=False)  # kept while the second probes
            gc.collect()
            held = device.current_bytes
            second = autobatch.find_max_batch(step, cache=cache, estimate_first=False)
            gc.collect()
            assert second.batch_size == first.batch_size
            assert device.current_bytes == held
        _assert_same(before, _state(model, optimizer, scheduler, scaler))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False
