"""The resume warning of a dropped grad scaler names float16 only where this run has float16.

A checkpoint of a run that scaled its loss (an enabled ``GradScaler``), resumed by a run with no
scaler, warned "float16 gradients are not scaled (small ones become zero); pass grad_scaler=..."
even where the resumed run trains in float32 or bfloat16, which has no float16 gradient and needs
no scaling. Now that cost (and the advice) is named only for a run in float16 autocast or with
float16 weights; any other says it needs no loss scaling.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autobatch import Runner
from autobatch.training.precision import warn_changed_precision

G = 16


def _data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(G, 6, generator=generator), torch.randn(G, 1, generator=generator)) for _ in range(3)]


def _fit(tmp_path, autocast, scaler, *, resume=False, steps=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.01),
                  lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]), global_batch=G, micro_batch=8,
                  autocast_dtype=autocast, grad_scaler=scaler, progress=False, log_every=None,
                  checkpoint_dir=tmp_path).fit(_data(), steps=steps, resume=tmp_path if resume else None)


@pytest.mark.parametrize(("autocast", "float16"), [(None, False), ("bfloat16", False), ("float16", True)])
def test_a_dropped_scaler_names_float16_only_for_a_float16_run(tmp_path, caplog, autocast, float16):
    _fit(tmp_path, "float16", torch.amp.GradScaler("cpu"))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        _fit(tmp_path, autocast, None, resume=True, steps=2)
    told = [r.getMessage() for r in caplog.records if "scaled its loss with a grad scaler" in r.getMessage()]
    assert len(told) == 1
    assert ("float16 gradients are not scaled" in told[0]) is float16
    assert ("needs no loss scaling" in told[0]) is not float16


def test_float16_weights_keep_the_float16_cost(caplog):
    state = {"precision": {"autocast": None, "grad_scaler": True}, "grad_scaler": {"scale": 1024.0}}
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        warn_changed_precision(state, {"autocast": None, "grad_scaler": False}, weights=torch.float16)
    assert "float16 gradients are not scaled" in caplog.records[-1].getMessage()


def test_review36_a_dropped_scaler_names_a_bfloat16_model_by_its_dtype(tmp_path, caplog):
    """An fp16 (scaled) checkpoint resumed into a bfloat16 model without autocast was told "this run trains in
    float32, not float16": the run without autocast is named by its weights' dtype."""
    _fit(tmp_path, "float16", torch.amp.GradScaler("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.01),
                    lambda m, b: nn.functional.mse_loss(m(b[0].to(torch.bfloat16)).float(), b[1]), global_batch=G,
                    micro_batch=8, progress=False, log_every=None)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(_data(), steps=2, resume=tmp_path)
    told = [r.getMessage() for r in caplog.records if "scaled its loss with a grad scaler" in r.getMessage()]
    assert len(told) == 1 and "this run trains in bfloat16 (its weights' dtype), not float16" in told[0]
