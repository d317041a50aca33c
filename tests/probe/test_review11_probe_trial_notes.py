"""Errors a probe's step raises that are not out-of-memory errors: still raised unchanged, now
with what the user needs to act on them.

* A step that refuses some sizes (a batch split in pairs) failed at a size the search jumped to,
  2439, with a bare shape error: the note names the size, the sizes that passed and multiple_of.
* The estimate's trace of such a step logged PyTorch's 20-line "failed while attempting to run
  meta" traceback at ERROR level ahead of the real error, though the estimate handles it.
* ``strategy="estimate"`` on a step the trace cannot follow said what failed, not what to do.
"""

from __future__ import annotations

import logging

import pytest
import torch

from autobatch import TrainStep, find_max_batch
from autobatch.probe.tracing.estimate import EstimateError


class _Pairs(torch.nn.Module):
    """Splits its batch in pairs: an odd batch is a shape error, at any memory."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 8)

    def forward(self, x):
        out = self.layer(x)
        return out.view(out.shape[0] // 2, 2, 8)


def _step(model):
    return TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b).pow(2).mean(),
                     lambda n: torch.randn(n, 16))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_an_error_at_a_size_after_others_passed_names_them_and_multiple_of():
    torch.manual_seed(0)
    step = _step(_Pairs())
    weight = step.model.layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match="is invalid for input of size") as caught:
        find_max_batch(step, memory_limit="2MiB", cache=False)
    (note,) = caught.value.__notes__
    size = int(note.split("probe trial at batch ")[1].split(",")[0])
    assert size % 2 and "after trials at 8, " in note and "Pass multiple_of" in note
    assert "multiple of 8 and" in note and "divides 8" in note
    assert torch.equal(step.model.layer.weight, weight)
    assert find_max_batch(step, memory_limit="2MiB", cache=False, multiple_of=2).batch_size % 2 == 0


def test_an_error_at_the_first_trial_gets_no_size_note_and_the_trace_logs_nothing():
    """Nothing passed: the step's error at any size, the batch size is no clue. The estimate's
    trace met the same error first, and PyTorch logged its traceback at ERROR level."""
    model = torch.nn.Linear(16, 8)
    step = TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b[:, :8]).sum(),
                     lambda n: torch.randn(n, 16))
    logs, logger = _Records(), logging.getLogger("torch._subclasses.fake_tensor")  # torch's loggers do not propagate
    logger.addHandler(logs)
    try:
        with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
            find_max_batch(step, memory_limit="2MiB", cache=False)
    finally:
        logger.removeHandler(logs)
    assert not getattr(caught.value, "__notes__", None)
    assert not [r for r in logs.records if r.levelno >= logging.ERROR]


def test_an_untraceable_step_says_to_probe_with_trials():
    class Reads(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x / (1 + x.abs().max().item()))

    model = Reads(16, 8)
    step = TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b).sum(), lambda n: torch.randn(n, 16))
    with pytest.raises(EstimateError, match=r"could not trace .*; probe with real trials \(strategy='binary'"):
        find_max_batch(step, memory_limit="2MiB", cache=False, strategy="estimate")
    result = find_max_batch(step, memory_limit="2MiB", cache=False, max_batch=64)  # auto: a note, then trials
    assert result.batch_size == 64 and not any("probe with real trials" in n for n in result.notes)
