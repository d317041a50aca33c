"""A step given up in the optimizer step is not advised what cannot help it.

With ``min_micro_batch`` above 1, a step out of memory at that floor raised a message of its own
that always advised ``checkpointing_fallback=True`` and "a lower min_micro_batch", also where
the optimizer step ran out of memory: activation checkpointing shrinks activations, and the
micro-batch does not size the optimizer step, so neither can help (at micro-batch 1 the default
message already said so).
"""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch import Runner, StepOutOfMemoryError
from runner_workloads import make_data, make_model, mse


def _run(phase: str) -> StepOutOfMemoryError:
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    min_micro_batch=4, progress=False, log_every=None)
    autobatch.inject_oom(runner, at=[(1, phase)], times=None)
    with pytest.raises(StepOutOfMemoryError) as info:
        runner.fit(make_data())
    return info.value


def test_an_optimizer_step_that_fits_at_no_micro_batch_is_advised_for_the_optimizer():
    message = str(_run("optimizer"))
    assert "optimizer" in message and "micro-batch 8" in message  # not shrunk: it does not size the optimizer step
    assert "checkpointing_fallback" not in message and "lower min_micro_batch" not in message
    assert "optimizer with less state" in message


def test_a_backward_that_fits_at_no_micro_batch_still_names_the_fallback_and_the_floor():
    message = str(_run("backward"))
    assert "checkpointing_fallback=True" in message and "lower min_micro_batch" in message
