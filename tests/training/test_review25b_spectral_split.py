"""Spectral norm in the Runner's own split (review 25): each micro-batch's forward runs a power
iteration, so a step trained in pieces (``micro_batch < global_batch``, or a replay after an
OOM) divides the weight by several estimates where one batch would use one. ``plan()`` noted
it, but a Runner that split the batch itself said nothing (it warned for BatchNorm only); a
Runner that planned must still say it once, not twice."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.utils import parametrizations

import autobatch

SAID = "Spectral norm in training mode (0: Linear, 2: Linear) runs a power iteration in every forward"


def sn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(parametrizations.spectral_norm(nn.Linear(8, 64)), nn.ReLU(),
                         parametrizations.spectral_norm(nn.Linear(64, 1)))


def runner(model: nn.Module, **options) -> autobatch.Runner:
    return autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), progress=False, log_every=None,
                            grow_after=None, **options)


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Spectral norm" in r.getMessage()]


def test_the_runners_own_split_warns_once_for_spectral_norm(caplog):
    data = [(torch.randn(10, 8), torch.randn(10, 1)) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner(sn_model(), global_batch=10, micro_batch=4).fit(data)
        runner(sn_model(), global_batch=10, micro_batch=10).fit(data)  # one piece per step: exact, nothing said
    told = said(caplog)
    assert len(told) == 1 and told[0].startswith(SAID), told
    assert "micro-batches of 4 and 3 divide each weight" in told[0] and "one batch of 10" in told[0]


def test_a_replay_after_an_oom_warns_once(caplog):
    data = [(torch.randn(10, 8), torch.randn(10, 1)) for _ in range(3)]
    run = runner(sn_model(), global_batch=10, micro_batch=10)
    autobatch.inject_oom(run, at=(1, "forward"))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        run.fit(data)
    told = said(caplog)
    assert len(told) == 1 and "micro-batches of 5 divide" in told[0], told


def test_a_runner_that_planned_a_split_warns_once(caplog):
    options = {"memory_limit": "40KiB", "max_batch": 16, "strategy": "binary", "steps_per_trial": 1, "cache": False,
               "estimate_first": False}
    run = runner(sn_model(), global_batch=64, plan_options=options)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        run.fit([(torch.randn(64, 8), torch.randn(64, 1))])
    told = said(caplog)
    assert run.micro_batch < 64 and len(told) == 1 and told[0].startswith("plan: Spectral norm"), told
