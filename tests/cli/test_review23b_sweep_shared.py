"""Review 23b: a sweep's ``summary.md`` names the overrides every job shares once, above the table.

In ``python -m autobatch train -m model=mlp data.shape=[16] train.lr=0.001,0.01`` every row's
``overrides`` cell repeated ``model=mlp data.shape=[16]`` and the ``lr`` that differs was hard to
spot (``summary.png`` already labelled the jobs by the differing ones alone). The printed table
(``summary.md``) now says the shared ones once; ``summary.csv`` keeps each job's in full.
"""

from __future__ import annotations

import csv

from autobatch.cli.sweep import ROW_FILE, render_markdown, write_summary

ROWS = [
    {"job": 0, "overrides": "model=mlp data.shape=[16] train.lr=0.001", "status": "ok", "batch_size": 64},
    {"job": 1, "overrides": "model=mlp data.shape=[16] train.lr=0.01", "status": "failed", "error": "boom"},
]


def test_the_shared_overrides_are_said_once_and_each_row_keeps_its_own():
    text = render_markdown(ROWS)
    assert text.splitlines()[0] == "overrides of every job: model=mlp data.shape=[16]"
    assert text.count("model=mlp") == 1
    rows = [line for line in text.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert [row.split(" | ")[1] for row in rows] == ["train.lr=0.001", "train.lr=0.01"]


def test_one_job_keeps_its_overrides_in_its_row_and_the_csv_keeps_every_jobs_in_full(tmp_path):
    assert render_markdown(ROWS[:1]).startswith("| job | overrides |")
    assert "| model=mlp data.shape=[16] train.lr=0.001 |" in render_markdown(ROWS[:1])
    for row in ROWS:
        job = tmp_path / str(row["job"])
        job.mkdir()
        (job / ROW_FILE).write_text(__import__("json").dumps(row), encoding="utf-8")
    write_summary(tmp_path, plot=False)
    with open(tmp_path / "summary.csv", newline="", encoding="utf-8") as handle:
        assert [row["overrides"] for row in csv.DictReader(handle)] == [row["overrides"] for row in ROWS]
    assert (tmp_path / "summary.md").read_text(encoding="utf-8") == render_markdown(ROWS)
