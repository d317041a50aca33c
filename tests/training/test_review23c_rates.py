"""``train_result.json`` (``RunResult.to_dict()``) had ``samples_per_s`` and ``elapsed_s`` with every
digit where ``metrics.jsonl`` rounds them, and the progress line's samples/s (the mean since the fit
began) read as a disagreement with that step's own ``samples_per_s``: it now says which it is."""

from __future__ import annotations

import io
import logging

from autobatch import RunResult
from autobatch.training import progress as progress_module
from autobatch.training.progress import Progress


def test_the_results_file_rounds_the_rate_and_seconds_as_metrics_jsonl_does_and_keeps_its_keys():
    result = RunResult(steps=3, samples=100, elapsed_s=3.0000004321, empty_cache_seconds=0.1234567891)
    assert result.to_dict()["samples_per_s"] == round(100 / 3.0000004321, 2)
    assert RunResult.from_dict(result.to_dict()) == result  # a checkpoint's copy stays exact
    data = result.rounded()  # what train_result.json holds
    assert data["samples_per_s"] == round(100 / 3.0000004321, 2) and data["elapsed_s"] == round(3.0000004321, 6)
    assert data["empty_cache_seconds"] == round(0.1234567891, 6)
    assert data.keys() == result.to_dict().keys() and RunResult.from_dict(data).samples == 100


def test_the_progress_line_names_its_rate_the_mean_since_the_fit_began(caplog, monkeypatch):
    clock = iter([0.0, 2.0, 3.0])  # the bar began; a first step of 2 s (warm-up), a second of 1 s
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="autobatch"):
        shown = Progress(2, bar=None, file=io.StringIO(), log_every=1)
        shown.update(1, 100, 100, 1, 0, 1.0)
        shown.update(2, 100, 100, 1, 0, 1.0)
    line = caplog.records[-1].getMessage()
    assert f"{200 / 3:.1f} samples/s (mean since this fit began)" in line  # the second step alone ran 100
