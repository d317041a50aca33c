"""A planned run with a disabled ``GradScaler`` trains, as one without a scaler.

``GradScaler(enabled=use_fp16)`` is the usual way to turn fp16 off; with ``micro_batch=None``
the runner copied the scaler for the plan's trials through ``load_state_dict``, which refuses a
disabled scaler's empty state: ``RuntimeError: The source state dict is empty`` before any step.
"""

from __future__ import annotations

import torch

from autobatch import Runner
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


def _fit(grad_scaler) -> Runner:
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=None,
                    grad_scaler=grad_scaler, progress=False, log_every=None,
                    plan_options={"memory_limit": "64MiB", "cache": False})
    runner.fit(make_data(), steps=3)
    return runner


def test_a_planned_run_with_a_disabled_scaler_trains_as_one_without():
    disabled = _fit(torch.amp.GradScaler("cpu", enabled=False))
    plain = _fit(None)
    assert disabled.step == 3 and disabled.micro_batch == plain.micro_batch
    assert_weights_close(weights(disabled.model), weights(plain.model))
