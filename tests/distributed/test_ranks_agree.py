"""Two ranks on the CPU (gloo): what the ranks agree on around the step, found wanting by a tester.

* uneven data (3 batches on rank 0, 4 on rank 1) is one ``UnevenDataError`` on every rank, not
  rank 0's epoch 2 silently paired with rank 1's epoch 1;
* a DDP model with buffers (BatchNorm) replays an OOM on one rank, in the runner and in the
  probe through DDP (DDP's forward-sync flag differed between the ranks, and the replay's
  buffer broadcast ran on one rank only: a hang);
* ``save()`` returns on no rank before rank 0's ``last.pt`` is written, and a checkpoint one
  rank cannot read (or write) is an error on every rank.

Each test launches ``agreement_worker.py`` once (a few seconds) with a 10 s sync deadline, so
a disagreement fails within it instead of hanging.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher import launch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

WORKER = Path(__file__).resolve().parent / "agreement_worker.py"


def _run(scenario: str, tmp_path: Path) -> list[dict]:
    return launch(WORKER, scenario, tmp_path, timeout=120, SYNC_TIMEOUT="10")


def test_ranks_with_uneven_data_fail_together_with_one_clear_error(tmp_path):
    reports = _run("uneven", tmp_path)
    for rank, report in enumerate(reports):
        listed = report["list"]  # lengths known: compared before the first epoch trains
        assert listed["trained"] == [], (rank, listed)
        assert "different numbers of batches per epoch (rank 0: 3, rank 1: 4)" in listed["error"]
        assert "DistributedSampler" in listed["error"]
        stream = report["stream"]  # no length: checked at each step, fails where rank 0's data runs out
        assert stream["trained"] == [[1, 0], [2, 0], [3, 0]], (rank, stream)
        assert "the data of rank 0 ran out after 3 batches of epoch 1 while rank 1 still had one" in stream["error"]
        assert report["even"] == {"steps": 6, "epochs": 2}
    assert reports[0]["list"]["error"] == reports[1]["list"]["error"]


def test_a_ddp_model_with_buffers_replays_an_oom_on_one_rank(tmp_path):
    reports = _run("ddp_buffers", tmp_path)
    for report in reports:
        assert (report["recoveries"], report["steps"], report["samples"]) == (1, 3, 48)
        for got, want in zip(report["state"], report["reference"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-10, atol=1e-12)
    assert reports[0]["state"][:4] == reports[1]["state"][:4]  # the parameters, bit for bit
    assert reports[0]["probe"] == reports[1]["probe"] and reports[0]["probe_trials"] == reports[1]["probe_trials"]
    assert len(set(reports[0]["probe_trials"])) > 1  # trials that passed on rank 0 failed on rank 1


def test_a_checkpoint_is_written_before_any_rank_returns_and_read_errors_are_agreed(tmp_path):
    reports = _run("checkpoints", tmp_path)
    for rank, report in enumerate(reports):
        assert report["seen_step"] == 2 and report["resumed_steps"] == 4, (rank, report)
        assert "could not read it" in report["unreadable"] if rank == 0 else "cannot read it" in report["unreadable"]
    assert [report["failed_write"] for report in reports] == ["OSError", "PeerFailedError"]
