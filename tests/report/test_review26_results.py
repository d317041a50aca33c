"""Results a user keeps and shares: a short repr that says the answer and why, and strict JSON
(no NaN token) for a run whose loss diverged."""

from __future__ import annotations

import json
import math

import autobatch
from autobatch import Plan, ProbeResult, RunResult
from autobatch.probe.trial import TrialRecord


def _probe(trials: int = 40) -> ProbeResult:
    records = [TrialRecord(batch_size=b, passed=b <= 20, peak_bytes=1000 * b, seconds=0.1) for b in range(1, trials + 1)]
    return ProbeResult(batch_size=18, strategy="auto", strategy_used="binary", trials=records, capacity_bytes=21_000,
                       elapsed_s=1.5, margin=0.1, largest_passed=20, smallest_failed=21, device="cpu",
                       notes=["a long note " * 20], diagnostics={"memory_summary": "x" * 2000})


def test_probe_result_repr_is_one_short_line_with_the_answer():
    result = _probe()
    text = repr(result)
    assert "\n" not in text and len(text) < 300, text
    assert "batch_size=18" in text and "binary" in text and "largest_passed=20" in text and "40 trials" in text
    assert str(result) == result.summary()  # print(result): the readable lines, not the 40 trial records


def test_plan_and_run_result_repr_are_short():
    probe = _probe().to_dict()
    plan = Plan(global_batch=64, micro_batch=16, accumulation_steps=4, micro_batch_sizes=[16, 16, 16, 16],
                checkpointing=False, reason="the largest micro-batch that fits", probes=[{"result": probe}] * 3)
    run = RunResult(steps=5, steps_this_run=5, samples=320, micro_batch=16, global_batch=64, last_loss=0.25,
                    plan=plan.to_dict(), oom_recoveries=[{"step": 1}] * 50)
    for value, wanted in ((plan, "micro_batch=16"), (run, "steps=5")):
        text = repr(value)
        assert "\n" not in text and len(text) < 300 and wanted in text, text
    assert "the largest micro-batch that fits" in repr(plan) and "50 OOM recoveries" in repr(run)


def test_run_result_with_a_nan_loss_is_strict_json_and_reads_back():
    for loss in (math.nan, math.inf, -math.inf):
        run = RunResult(steps=1, last_loss=loss, nonfinite_loss_steps=1)
        text = json.dumps(run.to_dict(), allow_nan=False)  # NaN is no JSON (jq, JSON.parse refuse it)
        again = RunResult.from_dict(json.loads(text))
        assert math.isnan(again.last_loss) if math.isnan(loss) else again.last_loss == loss
        assert json.loads(run.to_json())["last_loss"] == str(loss)
    assert RunResult.from_dict(RunResult(last_loss=0.5).to_dict()).last_loss == 0.5


def test_plot_without_matplotlib_is_one_message(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    try:
        autobatch.plot_probe(_probe(), tmp_path / "curve.png")
    except ImportError as exc:
        assert "pip install 'matplotlib" in str(exc) and "probe.plot=false" in str(exc)
        assert exc.__cause__ is None and exc.__suppress_context__  # not a second traceback from inside
    else:
        raise AssertionError("plot_probe drew without matplotlib")
    assert not (tmp_path / "curve.png").exists()


def test_review35_probe_summary_edges() -> None:
    """A probe capped by max_batch says so (it read as the memory boundary); a cached result's trials
    are the stored probe's; an estimate's margin has no boundary ("boundary None"); a note's further
    lines stay in the value column; one trial is "1 trial"."""
    one = [TrialRecord(batch_size=40, passed=True, peak_bytes=4000, seconds=0.1)]
    capped = ProbeResult(batch_size=40, strategy="binary", strategy_used="binary", trials=one, capacity_bytes=8000,
                         elapsed_s=0.0, margin=0.0, max_batch=40, largest_passed=40, device="cpu", cached=True,
                         notes=["line one\nline two"])
    text = capped.summary()
    assert "capped          at max_batch=40: no trial up to it ran out of memory" in text
    assert "trials          1 trial (0 OOM), the stored probe's" in text and "1 trials" not in repr(capped)
    assert "note            line one\n                line two" in text
    estimate = ProbeResult(batch_size=2471, strategy="estimate", strategy_used="estimate", trials=[], capacity_bytes=8000,
                           elapsed_s=0.6, margin=0.1, tested=False)
    assert "margin          10%" in estimate.summary() and "None" not in estimate.summary()
    assert ProbeResult.from_dict(json.loads(json.dumps(capped.to_dict(), allow_nan=False))).summary() == text


def test_review35_plan_summary_multiline_reason() -> None:
    """A plan's reason or note with a newline keeps its further lines in the value column."""
    plan = Plan(global_batch=10, micro_batch=4, accumulation_steps=3, micro_batch_sizes=[4, 3, 3], checkpointing=True,
                checkpointed_modules=["a", "b"], reason="fits\nonly checkpointed", notes=["x\ny"])
    text = str(plan)
    assert "sizes 4 x 1 + 3 x 2 = 10" in text and "on, 2 modules (a, b)" in text
    assert "reason          fits\n                only checkpointed" in text and "note            x\n                y" in text
    assert Plan.from_dict(json.loads(plan.to_json(allow_nan=False))).summary() == text


def test_review35_an_estimates_note_and_a_one_trial_plot_title_read_as_units():
    """The estimate's note gave its peak in raw bytes (``peak 8387472 B``) where every other line uses
    units, and the plot's title said "1 trials"."""
    import torch

    from autobatch import TrainStep, find_max_batch
    from autobatch.probe.records import TrialRecord
    from autobatch.probe.result import ProbeResult
    from autobatch.report.plots import _title

    model = torch.nn.Linear(8, 2)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                     lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,))))
    result = find_max_batch(step, strategy="estimate", memory_limit="8MiB", cache=False)
    note = next(n for n in result.notes if n.startswith("untested estimate"))
    assert "iB)" in note and " B)" not in note, note
    one = ProbeResult(batch_size=1, strategy="binary", strategy_used="binary", trials=[TrialRecord(1, True, 1 << 20, 0.1)],
                      capacity_bytes=1 << 30, elapsed_s=0.0, margin=0.0, steps_per_trial=3)
    assert "1 trial, 0 OOM" in _title(one)
