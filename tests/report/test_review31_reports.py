"""Review 31 of the reports: a plot leaves the session's matplotlib backend alone, its legend does
not hide the answer, and a result.json read as a dict is told how to become a ProbeResult."""

from __future__ import annotations

import pytest

import autobatch
from autobatch import ProbeResult
from autobatch.probe.trial import TrialRecord
from autobatch.report import plots

matplotlib = pytest.importorskip("matplotlib")


def _capped() -> ProbeResult:
    """A probe capped by max_batch (as a plan's is by its global batch): one trial, a low peak."""
    trial = TrialRecord(batch_size=4, passed=True, peak_bytes=3 * 1024**2, seconds=0.1)
    return ProbeResult(batch_size=4, strategy="auto", strategy_used="predict", trials=[trial],
                       capacity_bytes=64 * 1024**2, elapsed_s=0.3, margin=0.0, max_batch=4, largest_passed=4,
                       device="cpu", fit={"slope_bytes_per_sample": 2726.0, "intercept_bytes": 3 * 1024**2 - 4 * 2726.0})


def test_review31_a_plot_leaves_the_session_backend(tmp_path):
    """``matplotlib.use("Agg", force=True)`` switched a notebook's or a GUI's backend for the rest of
    the session: its ``plt.show()`` drew nothing after the first plot was written."""
    before = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        autobatch.plot_probe(_capped(), tmp_path / "curve")
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)


def test_review31_the_legend_does_not_hide_the_answer(tmp_path, monkeypatch):
    """The legend sat in the lower right, over a capped probe's chosen batch and its passed dot."""
    figures = []
    monkeypatch.setattr(plots._pyplot(), "close", figures.append)
    autobatch.plot_probe(_capped(), tmp_path / "curve.png")
    axis = figures[0].axes[0]
    legend = axis.get_legend().get_window_extent()
    x, y = axis.transData.transform((4, 3))  # the passed dot, 3 MiB
    assert not legend.contains(x, y)


def test_review31_a_result_json_dict_is_told_from_dict(tmp_path):
    data = _capped().to_dict()
    with pytest.raises(TypeError, match=r"got dict; read a result.json back with ProbeResult.from_dict"):
        autobatch.plot_probe(data, tmp_path / "curve.png")
    assert autobatch.plot_probe(ProbeResult.from_dict(data), tmp_path / "curve.png").is_file()
