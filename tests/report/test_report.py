"""Reports: memory-curve and sweep plots (real PNGs), diagnostics in results and errors,
the terminal table and trial progress."""

from __future__ import annotations

import io
import logging
import json

import pytest
import torch

import autobatch
from autobatch.cli.display import print_result, render_table, trial_progress
from autobatch.memory.diagnostics import memory_diagnostics
from autobatch.report.plots import plot_probe, plot_sweep
from autobatch.probe.trial import watch_trials
from conftest import SMALL
from workloads import MemoryCurveStep, make_mlp_step

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes"


def linear_probe(**kwargs):
    """A probe whose memory curve is exactly 2 KiB + 1 KiB per sample under a 256 KiB budget."""
    step = MemoryCurveStep(lambda b: 2048 + 1024 * b)
    return autobatch.find_max_batch(step, memory_limit="256KiB", steps_per_trial=1, **kwargs)


def test_auto_probe_plot_has_a_fit_and_is_a_png(tmp_path):
    result = linear_probe(strategy="auto", margin=0.1)
    assert result.fit is not None and result.num_ooms >= 1
    path = plot_probe(result, tmp_path / "curve.png")
    assert path == tmp_path / "curve.png"
    assert_png(path)


def test_binary_probe_without_fit_plots_and_trial_throughput_panel(tmp_path):
    result = linear_probe(strategy="binary")
    assert result.fit is None
    assert_png(plot_probe(result, tmp_path / "binary.png"))
    assert_png(plot_probe(result, tmp_path / "binary_speed.png", trial_throughput=True, title="custom"))


def test_untested_estimate_plots(tmp_path):
    step = make_mlp_step(width=64, in_features=16)
    result = autobatch.find_max_batch(step, strategy="estimate", memory_limit="2MiB", max_batch=4096)
    assert not result.tested and result.trials == []
    assert_png(plot_probe(result, tmp_path / "estimate.png"))


def test_plan_with_candidates_adds_the_throughput_panel(tmp_path):
    step = make_mlp_step(width=64, in_features=16)
    ticks = iter(range(10_000))
    plan = autobatch.plan(
        step, global_batch=256, objective="throughput", memory_limit="1MiB", steps_per_trial=1,
        timed_steps=1, warmup_steps=0, timer=lambda: float(next(ticks)), cache=False,
    )
    assert any(c.get("samples_per_s") for c in plan.candidates)
    single = plot_probe(plan.probe_results[0], tmp_path / "single.png")
    with_plan = plot_probe(plan.probe_results[0], tmp_path / "plan.png", plan=plan)
    assert_png(with_plan)
    assert with_plan.stat().st_size > single.stat().st_size  # the second panel is drawn


def test_plot_probe_is_exported_and_matplotlib_stays_lazy(tmp_path):
    import subprocess
    import sys

    from conftest import cli_env

    code = "import sys, autobatch; print(callable(autobatch.plot_probe), 'matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def test_plot_sweep_draws_ok_and_failed_jobs(tmp_path):
    rows = [
        {"job": 0, "overrides": "model=mlp", "status": "ok", "batch_size": 128, "time_s": 1.5},
        {"job": 1, "overrides": "model=gpt probe.memory_limit=1KiB", "status": "failed", "batch_size": None,
         "time_s": None, "error": "No batch size fits"},
        {"job": 2, "overrides": "model=cnn", "status": "ok", "batch_size": "64", "time_s": "2.25"},  # CSV strings
    ]
    assert_png(plot_sweep(rows, tmp_path / "sweep.png"))


# -- diagnostics ---------------------------------------------------------------------------------
DIAGNOSTIC_KEYS = (
    "allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
    "fragmentation_gap_bytes", "num_alloc_retries", "num_ooms", "memory_summary",
)


def test_probe_result_carries_diagnostics_and_round_trips():
    result = linear_probe(strategy="binary")
    diagnostics = result.diagnostics
    assert diagnostics is not None and all(key in diagnostics for key in DIAGNOSTIC_KEYS)
    assert diagnostics["capacity_bytes"] == 256 * 1024
    assert diagnostics["fragmentation_gap_bytes"] == 0  # the simulated device reserves what it allocates
    assert diagnostics["num_ooms"] == result.num_ooms
    assert "budget" in diagnostics["memory_summary"] and "256.00 KiB" in diagnostics["memory_summary"]
    again = autobatch.ProbeResult.from_dict(json.loads(result.to_json()))
    assert again.diagnostics == diagnostics
    old = result.to_dict()
    del old["diagnostics"]  # a result stored before diagnostics existed still loads
    assert autobatch.ProbeResult.from_dict(old).diagnostics is None


def test_no_fit_error_carries_diagnostics_and_a_compact_line():
    step = MemoryCurveStep(lambda b: 4096 * b)
    with pytest.raises(autobatch.NoBatchFitsError) as caught:
        autobatch.find_max_batch(step, memory_limit="2KiB", steps_per_trial=1)
    error = caught.value
    assert all(key in error.diagnostics for key in DIAGNOSTIC_KEYS)
    assert error.diagnostics["failed_trial"]["batch_size"] == 1
    message = str(error)
    assert "allocated peak" in message and "reserved peak" in message and "gap" in message
    assert error.diagnostics["memory_summary"] not in message  # the full table stays on the attribute
    assert "\n" not in message


def test_memory_diagnostics_of_a_simulated_device():
    from autobatch.memory.devices import SimulatedDeviceMemory

    with autobatch.simulated_memory("1MiB") as simulation:
        keep = torch.zeros(1024)  # 4 KiB
        data = memory_diagnostics(SimulatedDeviceMemory(simulation))
        del keep
    assert data["allocated_bytes"] == 4096 and data["reserved_bytes"] == 4096
    assert data["num_alloc_retries"] is None  # the simulated device has no allocator retries


# -- terminal output and progress -----------------------------------------------------------------
def test_table_and_plain_output_name_every_figure():
    result = linear_probe(strategy="binary", margin=0.1)
    table = render_table(result, [("result", "/x/result.json")])
    plain = io.StringIO()
    print_result(result, [("result", "/x/result.json")], file=plain)
    for text in (table, plain.getvalue()):
        for label in ("batch size", "strategy", "trials", "peak memory", "capacity", "margin", "result"):
            assert label in text
    assert "headroom" in table and str(result.batch_size) in table


def test_watch_trials_sees_every_trial_start_and_end():
    seen = []
    with watch_trials(lambda b, purpose, record: seen.append((b, record is not None))):
        result = linear_probe(strategy="binary")
    assert len(seen) == 2 * result.num_trials
    assert [b for b, ended in seen if ended] == [t.batch_size for t in result.trials]


def test_trial_progress_on_a_terminal_prints_a_line_per_trial():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    with trial_progress(file=screen):
        result = linear_probe(strategy="binary")
    text = screen.getvalue()
    assert text.count("trial ") >= result.num_trials and "OOM" in text
    quiet = io.StringIO()  # not a terminal: nothing (the log lines are the progress)
    with trial_progress(file=quiet):
        linear_probe(strategy="binary", cache=False)
    assert quiet.getvalue() == ""


# -- the command line ------------------------------------------------------------------------------
def test_cli_probe_writes_the_memory_curve_and_diagnostics(cli_here, tmp_path):
    done = cli_here("probe", "model=mlp", "probe.strategy=binary", "probe.memory_limit=1MiB", *SMALL[:-2], "probe.steps_per_trial=1")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    assert_png(run / "memory_curve.png")
    assert f"plot            {run / 'memory_curve.png'}" in done.stdout
    diagnostics = json.loads((run / "result.json").read_text())["diagnostics"]
    assert all(key in diagnostics for key in DIAGNOSTIC_KEYS)


def test_cli_probe_plot_false_draws_nothing(cli_here, tmp_path):
    done = cli_here("probe", "model=mlp", "probe.plot=false", *SMALL)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "run" / "memory_curve.png").exists() and "plot  " not in done.stdout


def test_cli_no_fit_error_names_the_memory_figures(cli_here):
    done = cli_here("probe", "model=gpt", "probe.memory_limit=256KiB", *SMALL)
    assert done.returncode == 1
    assert "autobatch: error: No batch size fits" in done.stderr and "reserved peak" in done.stderr


def test_cli_sweep_writes_summary_png(cli_here, tmp_path):
    done = cli_here("probe", "-m", "model=mlp", "probe.strategy=binary,halving", *SMALL)
    assert done.returncode == 0, done.stderr
    sweep = tmp_path / "sweep"
    assert_png(sweep / "summary.png")
    assert all((sweep / str(job) / "memory_curve.png").is_file() for job in range(2))
    assert "summary.png" in done.stdout


def test_trial_throughput_counts_each_trials_own_steps():
    """Search trials run one step and full trials steps_per_trial: samples/s uses each trial's."""
    from autobatch.report.plots import _trial_throughput
    from autobatch.probe.result import ProbeResult
    from autobatch.probe.trial import TrialRecord

    trials = [TrialRecord(8, True, 1, 2.0, steps=1), TrialRecord(16, True, 1, 2.0, steps=3),
              TrialRecord(32, True, 1, 2.0)]  # no steps: an older record, steps_per_trial ran
    result = ProbeResult(batch_size=16, strategy="binary", strategy_used="binary", trials=trials,
                         capacity_bytes=1, elapsed_s=0.0, margin=0.0, steps_per_trial=3)
    assert _trial_throughput(result) == [(8, 4.0), (16, 24.0), (32, 48.0)]


def test_plots_return_exactly_the_file_written(tmp_path, monkeypatch):
    """A path without a suffix, an existing directory and ``~`` used to come back as given
    while matplotlib wrote ``curve.png``, ``<dir>.png`` and ``./~/x.png``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = linear_probe(cache=False)
    rows = [dict(job=0, status="ok", batch_size=4, time_s=1.0)]
    plots = tmp_path / "plots"
    plots.mkdir()
    cases = [
        (plot_probe, plots / "curve", plots / "curve.png"),
        (plot_probe, plots, plots / "memory_curve.png"),
        (plot_probe, "~/x.png", tmp_path / "home" / "x.png"),
        (plot_sweep, plots / "sweep", plots / "sweep.png"),
        (plot_sweep, plots, plots / "summary.png"),
    ]
    for draw, given, written in cases:
        path = draw(result if draw is plot_probe else rows, given)
        assert path == written, (given, path)
        assert_png(path, min_bytes=1000)
    assert not (tmp_path / "~").exists() and not (tmp_path / "plots.png").exists()
    assert sorted(p.name for p in plots.iterdir()) == ["curve.png", "memory_curve.png", "summary.png", "sweep.png"]


def test_trial_progress_ignores_a_logging_handler_left_on_a_closed_stream():
    """A handler whose stream was closed (a test's or an app's captured stderr) is no terminal:
    asking it raised ValueError and stopped the probe before its first trial."""
    closed = io.StringIO()
    handler = logging.StreamHandler(closed)
    closed.close()
    logging.getLogger().addHandler(handler)
    try:
        with trial_progress(file=io.StringIO()):
            pass
    finally:
        logging.getLogger().removeHandler(handler)
