"""Review 15: a sweep plot's labels tell its jobs apart.

Each label was ``#<job> <overrides>`` cut to 48 characters, so a sweep with fixed overrides first
(``model=mlp data.shape=[16] train.micro_batch=4,8 model.width=16,32``) drew every label as
``#N model=mlp data.shape=[16] train.micro_batc...``. The overrides every job shares are left out.
"""

from __future__ import annotations

from autobatch.report.plots import _job_labels


def test_labels_keep_only_what_differs_between_jobs():
    fixed = "model=mlp data.shape=[16] 'data.dataset={_target_: my.Data, root: /d}' train.steps=3"
    rows = [{"job": i, "overrides": f"{fixed} train.micro_batch={mb} model.width={w}"}
            for i, (mb, w) in enumerate([(4, 16), (4, 32), (8, 16), (8, 32)])]
    assert _job_labels(rows) == ["#0 train.micro_batch=4 model.width=16", "#1 train.micro_batch=4 model.width=32",
                                 "#2 train.micro_batch=8 model.width=16", "#3 train.micro_batch=8 model.width=32"]


def test_a_value_with_spaces_is_one_override():
    rows = [{"job": 0, "overrides": "'data.dataset={_target_: a.A, size: 4}' x=1"},
            {"job": 1, "overrides": "'data.dataset={_target_: b.B, size: 4}' x=1"}]
    assert _job_labels(rows) == ["#0 'data.dataset={_target_: a.A, size: 4}'", "#1 'data.dataset={_target_: b.B, size: 4}'"]
