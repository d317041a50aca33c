"""Training steps that are not the textbook one, replayed after an OOM: the replayed step must end
with the weights of a run without the OOM, and whatever is stateful happen once per optimizer step.

A ``loss_fn`` ported from a hand-written loop that keeps its ``zero_grad()`` (or its
``scheduler.step()``) trained right at one micro-batch and, after a replay in smaller pieces,
silently on the last piece's gradient alone (or stepped the schedule once per piece): now one
error (:mod:`autobatch.training.grad_watch`). The rest (a scheduler given to the runner, EMA in
``on_step_end``, clipping, param groups with a frozen parameter, fp16 with a skipped step, bf16)
already replayed exactly; tested here so that it stays so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from autobatch import Runner, inject_oom
from autobatch.training.grad_watch import AccumulationBrokenError

X = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randn(32, 2, generator=torch.Generator().manual_seed(1))


def batches(x=X):
    return [(x[i:i + 8], Y[i:i + 8]) for i in range(0, 32, 8)]


def model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))


def mse(m, b):
    return F.mse_loss(m(b[0]), b[1])


def fit(net, optimizer, oom, loss_fn=mse, data=None, on_step_end=None, **options):
    runner = Runner(net, optimizer, loss_fn, global_batch=8, micro_batch=8, grow_after=None, progress=False, **options)
    if oom:
        inject_oom(runner, at=oom)
    result = runner.fit(data or batches(), epochs=1, on_step_end=on_step_end)
    return runner, result


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_in_loss_fn_is_refused_where_it_would_drop_a_piece(set_to_none):
    def loss_fn(m, b):
        m.zero_grad(set_to_none=set_to_none)  # a hand loop's habit, kept in loss_fn
        return mse(m, b)

    net = model()
    fit(net, torch.optim.SGD(net.parameters(), lr=0.1), None, loss_fn)  # one piece a step: nothing to lose, no error
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    runner = Runner(net, optimizer, loss_fn, global_batch=8, micro_batch=8, grow_after=None, progress=False)
    inject_oom(runner, at=[(1, "forward")])  # replayed as 4 + 4: the first 4's gradient was dropped, 0.02 off
    runner.fit(batches()[:1], epochs=1)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(AccumulationBrokenError, match="zero_grad.*inside loss_fn"):
        runner.fit(batches()[1:2] * 2, steps=2)
    assert runner.step == 1 and all(torch.equal(p, q) for p, q in zip(net.parameters(), before))  # the step undone


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_scheduler_stepped_in_loss_fn_is_refused_at_a_replay():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=4)

    def loss_fn(m, b):
        schedule.step()  # once per micro-batch: twice a step after the replay, OneCycleLR then raising at the end
        return mse(m, b)

    with pytest.raises(AccumulationBrokenError, match=r"scheduler\.step\(\) inside loss_fn.*Runner\(scheduler="):
        fit(net, optimizer, [(1, "forward")], loss_fn)


def stateful_run(oom):
    """OneCycleLR given to the runner, EMA in on_step_end, two groups of different lr, a frozen
    parameter, momentum and clipping of the accumulated gradient."""
    net = model()
    net[0].bias.requires_grad_(False)
    optimizer = torch.optim.SGD([{"params": [net[0].weight], "lr": 0.1}, {"params": list(net[2].parameters()), "lr": 0.01}],
                                momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.2, 0.02], total_steps=4)  # raises on a 5th step
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    hooks = []
    runner, _ = fit(net, optimizer, oom, scheduler=schedule, max_grad_norm=0.05, extra_state={"ema": ema},
                    on_step_end=lambda info: (hooks.append(info["step"]), ema.update_parameters(net)))
    return net, ema, schedule, hooks


@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_scheduler_ema_clipping_groups_once_per_step_through_replays(phase):
    plain, plain_ema, plain_schedule, _ = stateful_run(None)
    net, ema, schedule, hooks = stateful_run([(1, phase), (3, phase)])
    assert max_diff(plain, net) < 1e-6 and max_diff(plain_ema, ema) < 1e-6
    assert hooks == [1, 2, 3, 4] and int(ema.n_averaged) == 4 and schedule.last_epoch == plain_schedule.last_epoch == 4
    assert net[0].bias.grad is None and torch.equal(net[0].bias, model()[0].bias)  # frozen: untouched


def precision_run(oom, dtype):
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    x = X.clone()
    x[8:16] = 7e4  # step 1 overflows float16 (inf): the scaler skips it
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if dtype == "float16" else None
    runner, result = fit(net, optimizer, oom, data=batches(x if scaler else X), autocast_dtype=dtype, grad_scaler=scaler)
    adam_steps = optimizer.state[net[0].weight]["step"].item()
    return net, (scaler.get_scale() if scaler else None, result.skipped_steps, adam_steps)


@pytest.mark.parametrize("dtype,tolerance", [("float16", 1e-5), ("bfloat16", 1e-3)])
def test_autocast_and_scaler_replay_as_a_run_without_the_oom(dtype, tolerance):
    plain, plain_state = precision_run(None, dtype)
    net, state = precision_run([(1, "backward"), (2, "optimizer")], dtype)  # the skipped step replayed too
    assert max_diff(plain, net) < tolerance and state == plain_state
    if dtype == "float16":
        assert state[1] == 1 and state[2] == 3  # one step skipped, Adam stepped 3 times of 4
