"""Two CPU ranks (gloo): an error on one rank that no vote sees reaches the others at once.

* ``find_max_batch`` on a plain callable, or on a ``TrainStep`` of a plain module, whose trial
  raises a non-OOM error on rank 1 alone: rank 1 raises its own error, rank 0 a
  ``PeerFailedError`` naming it, at the same trial, instead of waiting out the sync deadline
  (``autobatch.dist.leaving``, through the probe agreement's ``left``).
* A store vote (FSDP's) that rank 1 gave up on at its deadline is a ``RankDisagreementError`` for
  rank 0 arriving later, not agreement (rank 0 went on alone into the collective it guards).
* An FSDP2 resume whose rank-1 file reads fine but does not fit rank 1's shards: one
  ``CheckpointError`` on every rank (``autobatch.training.ranks.agree_resume``), instead of rank 0
  training on and waiting out the deadline at its first step.
* ``Runner.fit`` where rank 1's data raises drawing a batch and rank 1 lingers: rank 1 raises its
  own error, rank 0 a ``PeerFailedError`` at once, under DDP (rank 0 used to wait in DDP's gradient
  buckets for as long as rank 1 lived), over a stream with no length (checked before each step),
  and at planning's first draw.
* ``Runner(multiple_of=4)`` under DDP: an OOM on rank 1 alone is replayed by both ranks at the same
  multiple.

One launch for all (the failing scenarios leave the ranks in step; the stale vote comes after the
probes so that the ranks' sync points pair again after it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import shared_launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "review11_worker.py"
SCENARIOS = ["probe_plain_error", "probe_module_error", "store_late_peer", "fsdp_resume_bad_shard", "ddp_multiple",
             "ddp_draw_error", "stream_draw_error", "plan_draw_error"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return shared_launch(tmp_path_factory, "review11_errors", WORKER, SCENARIOS, SYNC_TIMEOUT="4")[0]


@pytest.mark.parametrize("scenario, own", [("probe_plain_error", "ValueError"), ("probe_module_error", "KeyError")])
def test_a_probe_trial_error_on_one_rank_stops_every_rank_at_once(runs, scenario, own):
    rank0, rank1 = runs[scenario]
    assert rank1["error"] == own, rank1
    assert rank0["error"] == "PeerFailedError", rank0
    assert f"rank 1 ({own}: " in rank0["message"] and "batch 8" in rank0["message"], rank0["message"]
    # both stop at that trial together (the probe's own time up to it is load-dependent): not a deadline apart
    assert abs(rank0["seconds"] - rank1["seconds"]) < 0.5 * rank0["limit"], (rank0, rank1)


def test_a_store_vote_a_peer_gave_up_on_is_not_agreement_for_a_late_rank(runs):
    rank0, rank1 = runs["store_late_peer"]
    assert rank1["error"] == "RankDisagreementError" and "within 2 s" in rank1["message"], rank1
    assert rank0["error"] == "RankDisagreementError", rank0  # before: [[0], [1]], agreement
    assert "rank 1 gave up waiting for it" in rank0["message"] and rank0["seconds"] < 1.0, rank0


def test_one_fsdp_ranks_own_checkpoint_error_is_every_ranks(runs):
    rank0, rank1 = runs["fsdp_resume_bad_shard"]
    assert rank1["error"] == "CheckpointError" and "this rank's shard" in rank1["message"], rank1
    assert rank0["error"] == "CheckpointError" and "rank 1 could not load" in rank0["message"], rank0
    assert abs(rank0["seconds"] - rank1["seconds"]) < 0.5 * rank0["limit"], (rank0, rank1)


def test_runner_multiple_of_under_ddp_replays_one_ranks_oom_at_the_same_multiple(runs):
    """``Runner(multiple_of=4)``: rank 1's OOM is replayed by both ranks at a multiple (12 → 4),
    every sample trained once, the ranks' weights equal and those of the uninjected split."""
    reports = runs["ddp_multiple"]
    for report in reports:
        assert report["recoveries"] == [[12, 4]] and report["micro_batch"] == 4 and report["samples"] == 96
        for got, want in zip(report["state"], report["reference"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-10, atol=1e-12)
    assert reports[0]["state"] == reports[1]["state"]


@pytest.mark.parametrize("scenario, says", [("ddp_draw_error", "ValueError: rank 1's loader"),
                                             ("stream_draw_error", "drawing its batch for step 1"),
                                             ("plan_draw_error", "drawing its batch for step 0")])
def test_a_rank_whose_data_raises_stops_its_peers_at_once(runs, scenario, says):
    rank0, rank1 = runs[scenario]
    assert rank1["error"] == "ValueError" and "a corrupt sample" in rank1["message"], rank1
    assert rank0["error"] == "PeerFailedError" and says in rank0["message"], rank0
    assert abs(rank0["seconds"] - rank1["seconds"]) < 0.5 * rank0["limit"], (rank0, rank1)
    if scenario == "ddp_draw_error":  # rank 0 steps on the short second batch: its warning says which rank
        assert any(line.startswith("rank 0: a batch of 21 samples, not 24") for line in rank0["warnings"]), rank0
