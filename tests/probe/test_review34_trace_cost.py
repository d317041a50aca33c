"""Review 34: ``auto``'s estimate weighed against the search's first trial (a GRU's fake trace ran
a time step at a time: 2.9 s a trace, where the trials took 1.8 s in all)."""

import pytest
import torch

from autobatch import TrainStep, find_max_batch
from autobatch.probe.tracing import trace_cost
from autobatch.probe.tracing.estimate_records import EstimateError


def _step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return TrainStep(model, torch.optim.Adam(model.parameters()), lambda m, b: m(b).square().mean(),
                     lambda n: torch.randn(n, 16))


def test_review34_trace_cost_weighs_first_trace(monkeypatch):
    monkeypatch.setattr(trace_cost, "FLOOR_S", 1.0)  # the shipped floor (tests run with none: conftest)
    ticks = iter([0.0, 3.0, 10.0, 11.5, 20.0, 20.1])  # traces of 3 s, 1.5 s and 0.1 s
    traces, trials, seconds = [], [], iter([0.1, 1.0])  # trials of 0.1 s and 1 s
    cost = trace_cost.TraceCost(lambda: trials.append(8) or (8, next(seconds)), clock=lambda: next(ticks))
    with pytest.raises(EstimateError, match=r"30 times the search's first trial \(batch 8"):
        cost.first(lambda: traces.append(1))  # 3 s against a 0.1 s trial: the trial is the cheaper
    assert cost.first(lambda: traces.append(2) or "again") == "again"  # 1.5 s against 1 s: traced again after the trial
    assert traces == [1, 2, 2] and trials == [8, 8]
    assert cost.first(lambda: "quick") == "quick" and trials == [8, 8]  # under the floor: no trial weighed


def test_review34_dear_trace_stops_auto_estimate(monkeypatch):
    monkeypatch.setattr(trace_cost, "FLOOR_S", 0.0)
    monkeypatch.setattr(trace_cost, "RATIO", 1e-9)  # every trace dearer than the search's first trial
    result = find_max_batch(_step(), memory_limit="24KiB", cache=False)
    assert result.estimate is None and result.trials[0].batch_size == 8 and result.trials[0].purpose == "fit"
    assert any("times the search's first trial (batch 8" in note for note in result.notes)
    assert result.smallest_failed == result.batch_size + 1  # the search went on from that trial, exact

