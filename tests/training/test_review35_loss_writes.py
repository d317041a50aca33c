"""Review 35: state outside the model that ``loss_fn`` changes (an EMA updated there) is warned about once.

``loss_fn`` runs once per micro-batch and again for every micro-batch an OOM replay runs again; a
replay puts back the model's own state only. An EMA updated in ``loss_fn`` moved once per
micro-batch and kept a failed attempt's moves, without a word: the runner now warns once, naming
the tensor and ``on_step_end`` (:mod:`autobatch.training.loss_writes`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from autobatch import Runner

G = 8


def _fit(caplog, in_loss: bool) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    teacher = nn.Linear(4, 1).eval()  # read in loss_fn, never changed: not warned

    def loss_fn(m, batch):
        if in_loss:
            ema.update_parameters(m)
        with torch.no_grad():
            target = teacher(batch[0])
        return nn.functional.mse_loss(m(batch[0]), target)

    def on_step_end(info):
        if not in_loss:
            ema.update_parameters(model)

    data = [torch.randn(G, 4) for _ in range(3)]
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: loss_fn(m, (b,)),
                    global_batch=G, micro_batch=4, progress=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data, on_step_end=on_step_end)
    return [r.getMessage() for r in caplog.records if "outside the model" in r.getMessage()]


def test_review35_an_ema_updated_in_loss_fn_is_warned_once(caplog):
    told = _fit(caplog, in_loss=True)
    assert len(told) == 1, told  # six micro-batches wrote it: one warning
    assert "ema.module.0.weight (8, 4)" in told[0] and "on_step_end" in told[0] and "extra_state" in told[0]
    assert _fit(caplog, in_loss=False) == []  # the EMA in on_step_end, a frozen teacher in loss_fn: right


def test_review36_a_discriminator_stepped_in_loss_fn_is_told_the_gan_way(caplog):
    """Review 36: a ``loss_fn`` that steps a GAN's discriminator with its own optimizer was told to move an EMA to
    ``on_step_end``; now the warning says an optimizer stepped inside ``loss_fn`` (once per micro-batch, again on a
    replay) and to probe the step as a plain callable with ``restore`` and train it in a loop of one's own."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)

    def loss_fn(g, real):
        fake = g(torch.randn_like(real))
        opt_d.zero_grad(set_to_none=True)
        (disc(fake.detach()).mean() - disc(real).mean()).backward()
        opt_d.step()
        return -disc(fake).mean()

    runner = Runner(gen, torch.optim.SGD(gen.parameters(), lr=0.1), loss_fn, global_batch=G, micro_batch=4,
                    progress=False)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit([torch.randn(G, 4) for _ in range(2)])
    told = [r.getMessage() for r in caplog.records if "loss_fn changed" in r.getMessage()]
    assert len(told) == 1 and "disc.weight" in told[0], told
    assert "an optimizer of its own stepped it" in told[0] and "restore=(gen, opt_g, disc, opt_d)" in told[0]
    assert "on_step_end" not in told[0]
