"""Sequence-first batches (``[T, B, E]`` for an ``nn.LSTM(batch_first=False)``) that the runner
would split along time: one warning at the first step naming the module and the fix, where
``global_batch`` is T (no batch-size warning shows it) and the whole batch fits (no split yet: the
first OOM replay would cut it). A model that transposes batch-first batches itself is not warned;
later steps carry no hook."""

from __future__ import annotations

import logging

import torch
from torch import nn

from autobatch import Runner
from autobatch.training import sequence_first
from autobatch.training.sequence_first import SequenceFirst

T, B, E = 6, 3, 4


class Recurrent(nn.Module):
    def __init__(self, transpose: bool) -> None:
        super().__init__()
        self.transpose = transpose
        self.lstm = nn.LSTM(E, 5)  # batch_first=False, the default
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.transpose(0, 1) if self.transpose else x)
        return self.head(out[-1])


def fit(transpose: bool, caplog) -> Runner:
    torch.manual_seed(0)
    model = Recurrent(transpose)
    batches = [torch.randn(B, T, E) if transpose else torch.randn(T, B, E) for _ in range(2)]
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                    global_batch=B if transpose else T, micro_batch=None if transpose else T, progress=False,
                    plan_options={"memory_limit": "64MiB"} if transpose else None)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(batches)
    return runner


def test_sequence_first_batches_are_named_at_the_first_step(caplog):
    runner = fit(False, caplog)
    warned = [r.getMessage() for r in caplog.records if "batch_first=False" in r.getMessage()]
    assert len(warned) == 1 and "lstm (LSTM, input (6, 3, 4))" in warned[0] and "batch_first=True" in warned[0]
    assert runner.sequence_first.done and not runner.model.lstm._forward_pre_hooks  # no hook after the first step


def test_a_model_that_transposes_batch_first_batches_is_not_warned(caplog):
    fit(True, caplog)
    assert not [r for r in caplog.records if "batch_first=False" in r.getMessage()]


def test_a_compiled_model_gets_no_hook(monkeypatch):
    # a hook for the first step only would compile its graph a second time (torch.compile's own check,
    # probe.arguments.compiled_model, is stood in for: importing torch._dynamo takes seconds)
    model = Recurrent(False)
    assert not SequenceFirst(model).done
    monkeypatch.setattr(sequence_first, "compiled_model", lambda module: module is model)
    assert SequenceFirst(model).done
