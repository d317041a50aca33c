"""A ``train`` sweep's ``summary.png`` (``-m optimizer.lr=1e-3,1e-2``) drew "found batch" over
"probe time (s)": with ``train.micro_batch`` no probe ran, so the lower panel was empty, and the
losses the sweep compares were in no picture. Its rows (a ``final_loss`` column) now draw the
micro-batch trained at over the final loss; a probe sweep's picture is unchanged."""

from __future__ import annotations

from autobatch.report import plots


def _drawn(monkeypatch, rows, tmp_path):
    figures = []
    monkeypatch.setattr(plots._pyplot(), "close", figures.append)  # keep the figure to read its axes
    plots.plot_sweep(rows, tmp_path / "summary.png")
    return figures[0].axes


def test_a_train_sweep_plots_the_final_loss(monkeypatch, tmp_path):
    rows = [{"job": 0, "overrides": "optimizer.lr=0.001", "status": "ok", "batch_size": 4, "time_s": None,
             "final_loss": 2.5, "steps": 2},
            {"job": 1, "overrides": "optimizer.lr=0.01", "status": "ok", "batch_size": 4, "time_s": None,
             "final_loss": 1.25, "steps": 2}]
    batch_axis, lower = _drawn(monkeypatch, rows, tmp_path)
    assert (batch_axis.get_ylabel(), lower.get_ylabel()) == ("micro-batch", "final loss")
    assert [bar.get_height() for bar in lower.patches] == [row["final_loss"] for row in rows]
    probe_rows = [{**row, "final_loss": None, "time_s": 0.5} for row in rows]  # no loss: the probe's picture
    batch_axis, lower = _drawn(monkeypatch, probe_rows, tmp_path)
    assert (batch_axis.get_ylabel(), lower.get_ylabel()) == ("found batch", "probe time (s)")
