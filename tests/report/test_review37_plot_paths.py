"""Review 37: a plot path whose suffix matplotlib cannot write (``curve.xyz``, or ``run.v2``
meant as a name) was drawn first, then ``savefig`` raised matplotlib's bare ``Format 'v2' is not
supported``, naming neither the path nor what to give (:mod:`autobatch.report.plot_path`)."""

from __future__ import annotations

import pytest

import autobatch


def test_review37_a_plot_path_with_an_unknown_suffix_is_one_error_before_drawing(tmp_path, monkeypatch):
    from autobatch.report import plots

    monkeypatch.setattr(plots, "_pyplot", lambda: pytest.fail("the figure was drawn before the path was checked"))
    rows = [{"job": 0, "overrides": "model=mlp", "status": "ok", "batch_size": 8, "time_s": 1.0}]
    with pytest.raises(ValueError, match=r"run\.v2'.*end the path in \.png \(e\.g\. '.*run\.v2\.png'\)"):
        autobatch.plot_sweep(rows, tmp_path / "run.v2")
    assert not list(tmp_path.iterdir())
    assert plots.plot_file(tmp_path / "curve.PDF", "x.png").name == "curve.PDF"  # a format matplotlib writes
