"""BatchNorm trained in micro-batches is said once: each piece is normalised on its own.

Accumulation keeps every mean-reduced loss's gradient exact, except where the model reads the
batch's statistics: a BatchNorm model trained at global batch 10 in pieces of 4, 3, 3 (or after
an OOM recovery, at a smaller size than it planned) gets another gradient and other running
statistics than one batch of 10, and the runner said nothing of it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import autobatch

DATA = [(torch.randn(10, 5), torch.randn(10, 1)) for _ in range(3)]
SAID = "BatchNorm layers in training mode (1: BatchNorm1d) normalise each micro-batch with its own statistics"


def fit(model: nn.Module, micro_batch: int, oom_at: int | None = None) -> None:
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=10,
                              micro_batch=micro_batch, progress=False, grow_after=None)
    if oom_at is not None:
        autobatch.inject_oom(runner, at=(oom_at, "forward"))
    runner.fit(DATA)


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def test_batchnorm_in_micro_batches_is_warned_about_once(caplog):
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit(bn_model(), micro_batch=4)
    assert caplog.text.count(SAID) == 1 and "micro-batches of 4 and 3 train otherwise than one batch of 10" in caplog.text


def test_it_comes_when_a_recovery_first_splits_the_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit(bn_model(), micro_batch=10, oom_at=1)
    assert caplog.text.count(SAID) == 1 and "micro-batches of 5 train otherwise" in caplog.text


def test_no_warning_in_one_piece_with_frozen_batchnorm_or_with_layernorm(caplog):
    frozen = bn_model()
    frozen[1].eval()  # fine-tuning with frozen statistics: the batch's are not read
    layer_norm = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 1))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit(bn_model(), micro_batch=10)
        fit(frozen, micro_batch=4)
        fit(layer_norm, micro_batch=4)
    assert "BatchNorm" not in caplog.text


def test_a_runner_that_planned_a_split_warns_once(caplog):
    """``plan()`` warns where its split meets BatchNorm (review 14); a Runner that planned with it
    does not warn a second time at its first split step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.Linear(64, 1))
    data = [(torch.randn(64, 8), torch.randn(64, 1))]
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=64,
                              plan_options={"memory_limit": "40KiB", "max_batch": 16}, progress=False, log_every=None)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data)
    said = [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert runner.micro_batch < 64 and len(said) == 1, said
