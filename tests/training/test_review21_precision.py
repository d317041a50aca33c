"""Review 21: mixed precision through the runner, checkpoints and resume.

* fp16 autocast with a ``GradScaler``, accumulation, clipping, a scheduler, a skipped (inf) step
  and OOM replays ends where PyTorch's own AMP recipe does (unscale once per optimizer step,
  clip after it, the scheduler stepped every step, the skipped step counted once).
* A disabled scaler (``GradScaler(enabled=use_fp16)``) was recorded in checkpoints as a scaler,
  so a resume into a run without one warned of a scaler that never ran; a resume that drops or
  adds a scaler said only that the micro-batch "was sized for that precision", not that the
  learned scale is lost or starts afresh; a checkpoint's scaler settings silently replaced the
  resumed run's (its ``load_state_dict`` takes them).
* Float16 parameters (no float32 copy) or float16 autocast, trained without loss scaling, ran
  without a word: AdamW on a float16 model gave a NaN loss from its second step (its ``eps=1e-8``
  is 0 in float16). The runner now warns when it is made, naming what to change.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autobatch
from autobatch import Runner

G = 16


def _data():
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(G, 6, generator=generator) * 3, torch.randn(G, 1, generator=generator)) for _ in range(5)]
    data[2][0][3, 1] = float("inf")  # its gradients overflow: the scaler skips step 2 and backs off
    return data


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)


def _loss(model, batch):
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1])


def _scaled(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)
    return optimizer, scheduler, scaler


def test_fp16_scaler_accumulation_and_replays_end_where_the_amp_recipe_does():
    model = _model()
    optimizer, scheduler, scaler = _scaled(model)
    runner = Runner(model, optimizer, _loss, global_batch=G, micro_batch=4, autocast_dtype="float16", grad_scaler=scaler,
                    max_grad_norm=0.05, scheduler=scheduler, progress=False, balanced=False,
                    faults=autobatch.FaultInjector([(2, "optimizer"), (3, "backward")], times=1))
    result = runner.fit(_data(), epochs=1)
    assert result.skipped_steps == 1 and len(result.oom_recoveries) == 2 and runner.micro_batch == 2  # 4 again in the optimizer step
    reference = _model()
    ref_optimizer, ref_scheduler, ref_scaler = _scaled(reference)
    for x, y in _data():  # PyTorch's recipe: scaled backward per micro-batch, unscale, clip, step, update, schedule
        ref_optimizer.zero_grad()
        for i in range(0, G, 4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(reference, (x[i:i + 4], y[i:i + 4])) * 0.25
            ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_optimizer)
        nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_scaler.step(ref_optimizer)
        ref_scaler.update()
        ref_scheduler.step()
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-4, atol=1e-4)  # fp16 splits differ a little


def _fit(tmp_path, scaler, *, resume=False, steps=2):
    model = _model()
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.01), _loss, global_batch=G, micro_batch=8,
                  autocast_dtype="float16", grad_scaler=scaler, progress=False, log_every=None,
                  checkpoint_dir=tmp_path).fit(_data(), steps=steps, resume=tmp_path if resume else None)


@pytest.mark.parametrize(("first", "then", "says"), [
    ("disabled", None, None),  # nothing scaled in either run: no warning (it warned of "a grad scaler")
    ("enabled", "disabled", "scaled its loss with a grad scaler (scale 32768.0) and this run has none enabled"),
    (None, "enabled", "starts from its init_scale"),
    ("enabled", "settings", "growth_interval 2 (this run's 100)"),
])
def test_a_resume_says_what_a_changed_grad_scaler_costs(tmp_path, caplog, first, then, says):
    def scaler(kind):
        if kind is None:
            return None
        return torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=100 if kind == "settings" else 2,
                                    enabled=kind != "disabled")

    _fit(tmp_path, scaler(first))  # two clean steps: a scale of 2**14 grows once, to 32768
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["precision"]["grad_scaler"] is (first == "enabled")
    resumed = scaler(then)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        _fit(tmp_path, resumed, resume=True, steps=3)
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume:")]
    if says is None:
        assert not told
    else:
        assert len(told) == 1 and says in told[0]
    if then == "settings":  # loaded all the same, as the optimizer's settings are
        assert resumed.state_dict()["growth_interval"] == 2


@pytest.mark.parametrize(("dtype", "autocast", "scaled", "says"), [
    (torch.float16, None, False, "eps=1e-08 is 0 in float16"),
    (torch.float32, "float16", False, "autocast_dtype=float16 without an enabled grad_scaler"),
    (torch.bfloat16, None, False, None),
])
def test_float16_without_loss_scaling_is_warned_about_when_the_runner_is_made(caplog, dtype, autocast, scaled, says):
    model = _model(dtype)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _loss, global_batch=G, micro_batch=8,
               autocast_dtype=autocast, grad_scaler=scaler, progress=False)
    told = [r.getMessage() for r in caplog.records]
    assert (told == []) if says is None else (len(told) == 1 and says in told[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GradScaler is enabled where CUDA is")
def test_review32_a_cuda_scaler_on_the_cpu_is_named_with_the_scaler_to_pass(caplog):
    """Review 32: ``GradScaler()`` (a CUDA one, as docs and recipes write it) given to a run on the CPU
    is disabled by torch ("Disabling."), and the runner's warning said "without an enabled
    grad_scaler ... pass torch.amp.GradScaler(device)" to a user who passed one: it now says which
    scaler torch disabled and names the one to pass."""
    model = _model()
    with pytest.warns(UserWarning, match="Disabling"):
        scaler = torch.amp.GradScaler("cuda")
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _loss, global_batch=G, micro_batch=8,
               autocast_dtype="float16", grad_scaler=scaler, progress=False)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "GradScaler('cuda'), which torch disabled" in told[0]
    assert "pass grad_scaler=torch.amp.GradScaler('cpu')" in told[0]


@pytest.mark.parametrize(("dtype", "autocast", "says"), [
    (torch.float32, "bfloat16", "grad_scaler with autocast_dtype=bfloat16"),
    (torch.bfloat16, None, "grad_scaler with bfloat16 parameters"),
    (torch.float32, "float16", None),  # fp16: the scaler is needed
    (torch.float32, None, None),  # a loss_fn may run its own float16 autocast
])
def test_review34_a_grad_scaler_where_nothing_is_float16_is_warned_about(caplog, dtype, autocast, says):
    """Review 34: an enabled ``GradScaler`` with bfloat16 (autocast, or a bfloat16 model: the fp16
    recipe with its dtype changed) trained without a word; bfloat16 needs no loss scaling, and the
    scaler costs a device sync per step. The runner now warns when it is made, saying what to pass."""
    model = _model(dtype)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _loss, global_batch=G, micro_batch=8,
               autocast_dtype=autocast, grad_scaler=torch.amp.GradScaler("cpu"), progress=False)
    told = [r.getMessage() for r in caplog.records]
    assert (told == []) if says is None else (len(told) == 1 and says in told[0] and "grad_scaler=None" in told[0])


def test_review39_a_planned_run_copies_a_scaler_subclass_that_takes_no_device():
    """Review 39: the runner's plan stepped a scaler of its own, built as ``type(scaler)(device)``: a
    ``GradScaler`` subclass whose ``__init__`` takes no device raised a bare ``TypeError`` from inside
    ``fit()`` (``S.__init__() takes 1 positional argument but 2 were given``). It is copied now, and
    the run's scaler keeps its own state through the plan."""

    class Scaler(torch.amp.GradScaler):
        def __init__(self):
            super().__init__("cpu", init_scale=2.0**14, growth_interval=2)

    model = _model()
    scaler = Scaler()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.01), _loss, global_batch=G, autocast_dtype="float16",
                    grad_scaler=scaler, progress=False, log_every=None, plan_options={"memory_limit": 60_000, "cache": False})
    result = runner.fit(_data(), steps=3)
    assert result.plan is not None and result.skipped_steps == 1  # batch 2 holds an inf: grown at step 1, backed off at 2
    assert scaler.state_dict()["scale"] == 2.0**14 and scaler.state_dict()["_growth_tracker"] == 0
