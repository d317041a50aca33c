"""Two CPU ranks (gloo): an FSDP2 step whose peer stops coming ends within one sync deadline.

Rank 1 stalls in its own code at step 1; rank 0 waits at the vote before FSDP's next
all-gather. That vote's deadline is the error: the step's "failed" vote, which a rank casts
after its step raised, is not cast for a vote that itself could not complete (the ranks are out
of step then, so a second vote only waited another whole deadline before raising).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "review10_worker.py"


def test_an_fsdp_peer_that_stops_coming_is_an_error_after_one_deadline_not_two(tmp_path):
    reports = launch(WORKER, "fsdp_stalled", tmp_path, SYNC_TIMEOUT="4")
    rank0 = reports[0]
    assert rank0["error"] == "RankDisagreementError", rank0
    assert "within 4 s" in rank0["message"] and "FSDP vote" in rank0["message"], rank0["message"]
    # the whole fit: step 0 (well under a second) and one deadline, not two
    assert rank0["seconds"] < 1.6 * rank0["limit"], rank0
