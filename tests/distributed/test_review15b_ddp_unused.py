"""Two CPU ranks (gloo): a DDP model (DDP's defaults) whose forward leaves a parameter without a
gradient stops every rank at once with an error that says what to change.

Under ``find_unused_parameters=False`` DDP's reducer launches a bucket only once every parameter
in it has its gradient. Where rank 0 used the parameter and rank 1 did not, rank 0 waited in its
backward for rank 1's bucket and rank 1 at its vote, each until the sync deadline, and both then
raised a ``RankDisagreementError`` that named neither the parameter nor the fix; where no rank
used it, the step trained on gradients that were never all-reduced (the ranks' weights came apart)
and DDP's error came at the next step, wrapped as a disagreement. Now the rank checks DDP's reducer
after its backward (``autobatch.dist.ddp_step.check_reduced``): it raises a ``ValueError`` naming
the parameters and ``find_unused_parameters=True``, its peers a ``PeerFailedError``, in the
runner's step and in the probe's trial, with the weights untouched and the process group usable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import shared_launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "review15b_worker.py"
DEADLINE = 6.0
SCENARIOS = ["unused", "empty", "local_configs"]  # local_configs: test_review19_ddp_configs.py's


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return shared_launch(tmp_path_factory, "review15b_unused", WORKER, SCENARIOS, SYNC_TIMEOUT=str(DEADLINE))[0]


@pytest.fixture(scope="module")
def runs(launched):
    return launched["unused"]


def test_a_batch_one_rank_cannot_cut_stops_every_rank_at_that_step(launched):
    """Rank 1's batch is empty: it raised before the step, and rank 0 waited in DDP's next
    collective until the process group's timeout (30 min for gloo), then raised a disagreement that
    did not name the error. Now the error is carried to the step's vote, as a failed draw is."""
    own, peer = launched["empty"][1], launched["empty"][0]
    assert own["error"] == "ValueError" and "0 samples" in own["message"], own
    assert peer["error"] == "PeerFailedError" and "rank 1" in peer["message"] and "0 samples" in peer["message"], peer
    assert max(own["seconds"], peer["seconds"]) < DEADLINE / 2 and own["same"], (own, peer)


@pytest.mark.parametrize("case, skipped_on", [("never", (0, 1)), ("rank0", (1,)), ("probe", (1,))])
def test_a_parameter_without_a_gradient_under_ddp_stops_every_rank_at_once(runs, case, skipped_on):
    for rank, report in enumerate(runs):
        got = report[case]
        if rank in skipped_on:
            assert got["error"] == "ValueError", (rank, got)
        else:
            assert got["error"] == "PeerFailedError" and "rank 1 (ValueError" in got["message"], (rank, got)
        assert "b.weight, b.bias" in got["message"] and "find_unused_parameters=True" in got["message"], (rank, got)
        assert got["seconds"] < DEADLINE / 2, (rank, got)  # not a deadline's wait
        assert got["untouched"] and got["same"], (rank, got)  # no step of unreduced gradients
