"""Gradient clipping (``max_grad_norm``): the accumulated gradient of the global batch is
clipped once before each step, so the run equals a full-batch loop that clips, whatever the
micro-batch, through an OOM replay and with an fp16 grad scaler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import FaultInjector, Runner, TrainStep
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights

GLOBAL, NORM = 16, 0.05  # small enough that every step clips


def reference_run(data, steps: int) -> list[torch.Tensor]:
    """A hand loop on the full global batch that clips before each step."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in data[:steps]:
        optimizer.zero_grad()
        mse(model, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), NORM)
        assert norm > NORM  # the premise: clipping changes this step
        optimizer.step()
    return weights(model)


@pytest.mark.parametrize("micro_batch", [16, 4, 3])
def test_the_clipped_run_is_the_full_batch_loops_at_any_micro_batch(micro_batch):
    data = make_data(48, GLOBAL)
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), mse, global_batch=GLOBAL,
                    micro_batch=micro_batch, max_grad_norm=NORM, progress=False)
    runner.fit(data, epochs=1)
    assert_weights_close(weights(model), reference_run(data, 3))


def test_an_oom_replay_clips_the_replayed_step_once():
    data = make_data(48, GLOBAL)
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), mse, global_batch=GLOBAL,
                    micro_batch=8, max_grad_norm=NORM, progress=False,
                    faults=FaultInjector([(1, "optimizer"), (2, "backward")]))
    result = runner.fit(data, epochs=1)
    assert len(result.oom_recoveries) == 2
    assert_weights_close(weights(model), reference_run(data, 3))


def test_without_clipping_the_run_differs():
    """The premise of the tests above: at this norm, clipping changes the weights."""
    data = make_data(48, GLOBAL)
    model = make_model()
    Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), mse, global_batch=GLOBAL, micro_batch=4,
           progress=False).fit(data, epochs=1)
    clipped = reference_run(data, 3)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(weights(model), clipped))


def test_fp16_clips_the_unscaled_gradient():
    """With a grad scaler, the gradient is unscaled before it is clipped (the norm of a scaled
    gradient is meaningless), and scaler.step does not unscale it twice."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = TrainStep(model, optimizer, lambda m, b: (m(b) - 3).square().mean(), lambda n: torch.ones(n, 4),
                     autocast_dtype=torch.float16, grad_scaler=scaler, max_grad_norm=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    step(8)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert moved.norm().item() == pytest.approx(0.01, rel=1e-2)  # lr 1: the step is the clipped gradient


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "1", True])
def test_a_bad_max_grad_norm_names_the_argument(bad):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number or None"):
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), lambda n: torch.ones(n, 2),
                  max_grad_norm=bad)


def test_review37_hook_gets_the_applied_steps_grad_norm_before_clipping_through_replays():
    """``info["grad_norm"]``: the norm ``clip_grad_norm_`` returned for the global batch's gradient, once
    per step, of the attempt applied (an OOM replay in backward and in the optimizer step); the hook
    cannot compute it itself, the gradients being freed before it runs."""
    data = make_data(48, GLOBAL)
    expected = []
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in data[:3]:
        optimizer.zero_grad()
        mse(model, batch).backward()
        expected.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), NORM)))
        optimizer.step()
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), mse, global_batch=GLOBAL,
                    micro_batch=8, max_grad_norm=NORM, progress=False,
                    faults=FaultInjector([(1, "optimizer"), (2, "backward")]))
    logged = []
    runner.fit(data, epochs=1, on_step_end=logged.append)
    assert [info["grad_norm"] for info in logged] == pytest.approx(expected, rel=1e-9)
    model = make_model()
    unclipped = Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), mse, global_batch=GLOBAL, micro_batch=8,
                       progress=False)
    assert unclipped.fit(data, steps=1, on_step_end=logged.append) and logged[-1]["grad_norm"] is None
