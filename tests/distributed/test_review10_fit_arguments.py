"""Two CPU ranks (gloo): ``fit()``'s run-shaping arguments must be the same on every rank.

``Runner(..., checkpoint_dir=d if rank == 0 else None)`` (the habit of saving on rank 0) made
rank 0 enter the checkpoint's collective alone: an error at the first save mid-run, or rank 0
waiting out the whole sync timeout at the run's end, never naming the argument."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "review10_worker.py"


def test_checkpoint_dir_and_steps_on_rank_zero_only_is_one_error_on_every_rank_before_any_step(tmp_path):
    reports = launch(WORKER, "checkpoint_on_rank_zero", tmp_path, SYNC_TIMEOUT="30")
    for report in reports:
        assert report["error"] == "ValueError", report
        assert "checkpoint_dir: rank 0 set, rank 1 not set" in report["message"], report["message"]
        assert "steps: rank 0 2, rank 1 None" in report["message"], report["message"]
        assert report["step"] == 0 and report["seconds"] < 10, report  # at once, not after the timeout
    assert not reports[0]["written"]
