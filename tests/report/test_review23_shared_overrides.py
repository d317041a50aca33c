"""Review 23: the overrides every job of a sweep shares, read apart from each job's own
(:mod:`autobatch.report.overrides`, which ``summary.png``'s labels and ``summary.md`` use)."""

from __future__ import annotations

from autobatch.report.overrides import differing_overrides, shared_overrides, split_overrides


def test_shared_overrides_keep_the_first_rows_order_and_a_bracketed_value_whole():
    rows = [{"overrides": "'data.dataset={_target_: a.B, n: 2}' model=mlp train.lr=0.1"},
            {"overrides": "model=mlp train.lr=0.2 'data.dataset={_target_: a.B, n: 2}'"},
            {"overrides": float("nan")}]  # a row read back by pandas with an empty cell shares nothing
    assert shared_overrides(rows) == []
    assert shared_overrides(rows[:2]) == ["'data.dataset={_target_: a.B, n: 2}'", "model=mlp"]
    assert differing_overrides(rows[1], shared_overrides(rows[:2])) == ["train.lr=0.2"]
    assert split_overrides(None) == [] and shared_overrides(rows[:1]) == []
