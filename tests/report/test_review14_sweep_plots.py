"""Review 14 of the plots: a sweep's rows as pandas reads them back (a DataFrame) or as a file,
an interrupted job told from a failed one, a cached probe's title, and a missing matplotlib."""

from __future__ import annotations

import sys

import pytest

import autobatch.report.plots as plots
from autobatch.probe.result import ProbeResult
from autobatch.probe.trial import TrialRecord

PNG = b"\x89PNG\r\n\x1a\n"
ROWS = [
    {"job": 0, "overrides": "model=mlp", "status": "ok", "batch_size": 64, "time_s": 0.0},
    {"job": 1, "overrides": "model=gpt", "status": "failed", "batch_size": None, "time_s": None},
    {"job": 2, "overrides": "model=cnn", "status": "interrupted", "batch_size": None, "time_s": None},
]


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plots draw, kept open past their ``plt.close`` to be read."""
    figures = []
    real = plots._pyplot

    class Kept:
        def __init__(self, plt):
            self._plt = plt

        def __getattr__(self, name):
            return getattr(self._plt, name)

        def close(self, figure):
            figures.append(figure)

    monkeypatch.setattr(plots, "_pyplot", lambda: Kept(real()))
    yield figures
    for figure in figures:
        real().close(figure)


def test_a_dataframe_a_summary_csv_or_its_directory_are_rows(tmp_path):
    """``plot_sweep(pd.read_csv("summary.csv"), ...)`` iterated the column names and failed with
    ``'str' object has no attribute 'get'``; a path failed the same way."""
    pd = pytest.importorskip("pandas")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    pd.DataFrame(ROWS).to_csv(sweep / "summary.csv", index=False)
    for rows in (sweep / "summary.csv", str(sweep)):
        assert [row["status"] for row in plots._sweep_rows(rows)] == ["ok", "failed", "interrupted"]
    assert plots.plot_sweep(pd.read_csv(sweep / "summary.csv"), tmp_path / "s.png").read_bytes()[:8] == PNG
    with pytest.raises(TypeError, match="plot_sweep takes the sweep's rows"):
        plots.plot_sweep(["model=mlp"], tmp_path / "s.png")


def test_an_interrupted_job_is_not_counted_failed(tmp_path, drawn):
    """The CLI's last line says ``1 failed, 1 interrupted``; the picture said ``2 failed`` and
    marked the interrupted job ``failed``. An all-zero time axis went below 0."""
    plots.plot_sweep(ROWS, tmp_path / "s.png")
    batch_axis, time_axis = drawn[0].axes
    assert batch_axis.get_title() == "sweep: 3 jobs, 1 failed, 1 interrupted"
    assert [text.get_text() for text in batch_axis.texts] == ["64", "failed", "interrupted"]
    assert time_axis.get_ylim()[0] == 0


def test_a_cached_probes_title_says_no_trial_ran_now(tmp_path, drawn):
    """A result from the probe cache holds the stored trials: the title read ``2 trials, 0 OOM;
    0.01 s`` as if they had run in 0.01 s."""
    result = ProbeResult(batch_size=16, strategy="binary", strategy_used="binary", capacity_bytes=1 << 20,
                         trials=[TrialRecord(8, True, 1 << 19, 1.0), TrialRecord(16, True, 1 << 20, 1.0)],
                         elapsed_s=0.01, margin=0.0, steps_per_trial=3, cached=True)
    plots.plot_probe(result, tmp_path / "c.png")
    assert "from the probe cache (2 trials, 0 OOM stored)" in drawn[0].axes[0].get_title()


def test_a_missing_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'matplotlib>=3.7'.*probe\.plot=false"):
        plots.plot_sweep(ROWS, tmp_path / "s.png")


def test_review36_a_one_job_sweep_is_one_job(tmp_path, drawn):
    """A sweep of one job (or a summary.csv of one row) was titled ``sweep: 1 jobs, 0 failed``."""
    plots.plot_sweep(ROWS[:1], tmp_path / "s.png")
    assert drawn[0].axes[0].get_title() == "sweep: 1 job, 0 failed"


def test_review36_a_broken_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    """A matplotlib that imports but whose drawing module does not (a compiled part that fails to
    load; here ``matplotlib.figure`` stands in for it) gave a bare ``ModuleNotFoundError`` from
    inside ``plot_probe``, naming no install."""
    import matplotlib  # noqa: F401  (the package itself imports)

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = ProbeResult(batch_size=8, strategy="binary", strategy_used="binary", capacity_bytes=1 << 20,
                         trials=[TrialRecord(8, True, 1 << 19, 1.0)], elapsed_s=0.1, margin=0.0)
    with pytest.raises(ImportError, match=r"plots need matplotlib .*pip install 'matplotlib>=3.7'"):
        plots.plot_probe(result, tmp_path / "c.png")
