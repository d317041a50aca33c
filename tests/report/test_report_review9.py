"""Review 9 of the sweep plot: rows read back with pandas (failed jobs' empty cells are NaN), and
overrides that carry ``$`` (matplotlib reads text between two ``$`` as math)."""

import math

import pytest

from autobatch.report.plots import _job_labels, plot_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("missing", [math.nan, math.inf, "nan", "NaN"])
def test_a_failed_job_whose_empty_cells_read_as_nan_plots(tmp_path, missing):
    """``pandas.read_csv("summary.csv").to_dict("records")`` gives NaN for a failed job's empty
    batch and time: the plot stopped with "Axis limits cannot be NaN or Inf"."""
    rows = [
        {"job": 0, "overrides": "model=gpt", "status": "failed", "batch_size": missing, "time_s": missing},
        {"job": 1, "overrides": "model=mlp", "status": "ok", "batch_size": 64, "time_s": 1.5},
    ]
    path = plot_sweep(rows, tmp_path / "summary.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("overrides", ["tag=$HOME/run_$ seed=1", "a=$^$", "name=${oc.env:USER}_${now:%H}"])
def test_overrides_with_dollar_signs_are_drawn_as_written(tmp_path, overrides):
    """Two ``$`` in a job's overrides made matplotlib parse the text between them as math: the
    plot failed ("ParseSyntaxException") or drew a mangled label."""
    rows = [{"job": 0, "overrides": overrides, "status": "ok", "batch_size": 8, "time_s": 1.0}]
    path = plot_sweep(rows, tmp_path / "summary.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert _job_labels(rows)[0].replace("\\$", "$") == f"#0 {overrides}"[:48]


def test_a_sweep_of_thousands_of_jobs_plots_at_a_bounded_size(tmp_path):
    """One bar and label per job made 2000 jobs an 1800-inch figure (26 s); past
    ``SWEEP_LABELLED`` jobs every k-th is labelled and the width stays bounded."""
    from PIL import Image

    from autobatch.report.plots import SWEEP_LABELLED

    rows = [{"job": i, "batch_size": 100 + i % 7, "time_s": 1.0, "status": "ok", "overrides": f"x={i}"}
            for i in range(2000)]
    path = plot_sweep(rows, tmp_path / "big.png")
    width, _ = Image.open(path).size
    assert width <= (0.9 * SWEEP_LABELLED + 2) * 120 + 1
