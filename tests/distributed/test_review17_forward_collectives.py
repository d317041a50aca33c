"""A model whose forward runs its own collectives (``SyncBatchNorm``) is warned about once, at the
runner's start under ``torch.distributed``: an OOM on one rank inside it cannot be replayed
(``autobatch.dist.forward_collectives``). The docs said "not supported", and nothing said so."""

from __future__ import annotations

import logging

import torch
from torch import nn

from autobatch.dist.forward_collectives import warn_forward_collectives
from autobatch.dist.step import CollectiveDataParallel


def _model(norm) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.ReLU(), nn.Conv2d(4, 4, 3), norm(4))


def test_a_sync_batchnorm_model_is_warned_about_once_naming_its_modules(caplog):
    model = _model(nn.SyncBatchNorm)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert CollectiveDataParallel().local_module(model) is model  # the runner's start
        warn_forward_collectives(model)  # the probe's start: once per model
    warnings = [r.getMessage() for r in caplog.records if "SyncBatchNorm" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("1, 4 are SyncBatchNorm") and "use BatchNorm" in warnings[0]


def test_a_plain_batchnorm_model_is_not_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        warn_forward_collectives(_model(nn.BatchNorm2d))
    assert not caplog.records
