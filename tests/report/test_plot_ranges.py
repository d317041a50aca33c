"""plot_probe(result, path, plan=p): the throughput panel shows every timed candidate, those
with micro-batches past every trial of the probe drawn (checkpointed ones) included; it took
the memory panel's x-range and cut them off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import autobatch
from autobatch.report import plots
from workloads import MemoryCurveStep


def candidate(micro: int, checkpointing: bool, samples_per_s: float, chosen: bool = False) -> dict:
    return dict(micro_batch=micro, accumulation_steps=-(-64 // micro), checkpointing=checkpointing,
                samples_per_s=samples_per_s, chosen=chosen)


def test_both_panels_span_every_trial_and_candidate(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    result = autobatch.find_max_batch(MemoryCurveStep(lambda b: 2048 + 1024 * b), memory_limit="24KiB",
                                      steps_per_trial=1, max_batch=64)
    assert result.batch_size < 40
    plan = SimpleNamespace(candidates=[candidate(8, False, 10.0), candidate(result.batch_size, False, 20.0, True),
                                       candidate(48, True, 15.0), candidate(64, True, 14.0)])
    figures = []
    plt = plots._pyplot()
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda figure: (figures.append(figure), close(figure)))
    plots.plot_probe(result, tmp_path / "plan.png", plan=plan)
    memory_axis, throughput_axis = figures[0].axes
    assert memory_axis.get_xlim() == throughput_axis.get_xlim()
    low, high = throughput_axis.get_xlim()
    sizes = [c["micro_batch"] for c in plan.candidates] + [t.batch_size for t in result.trials]
    assert low <= min(sizes) and max(sizes) < high
