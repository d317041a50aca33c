"""Two CPU ranks (gloo): ``runner.request_stop()`` on one rank ends every rank after the same step.

Rank 1 alone asks after its third step (as a signal that reached one rank would); the request
rides on the next sync point, so both ranks end after step 4, write the checkpoint together and
return with ``result.stopped``; a resume from it ends with the uninterrupted run's weights
exactly, for a plain module, DDP and FSDP2. Before, a distributed run could only stop where it
was, and a checkpoint then (a collective) could not be written. One launch of
``stop_worker.py``'s scenarios, shared with ``test_stop_review.py`` (``launcher.stop_runs``).
"""

from __future__ import annotations


import pytest
import torch

from launcher import stop_runs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp"])
def test_a_stop_asked_on_one_rank_ends_every_rank_after_the_same_step_and_resumes_exactly(tmp_path_factory, kind):
    reports = stop_runs(tmp_path_factory)[f"stop_{kind}"]
    for rank, report in enumerate(reports):
        assert report["stopped"] is True, (rank, report)
        assert report["stopped_at"] == report["checkpoint_step"] == 4, (rank, report)  # asked after 3, carried by 4
        assert report["resumed_steps"] == 16 and report["resumed_stopped"] is False, (rank, report)
        assert report["same_weights"], (rank, report)
