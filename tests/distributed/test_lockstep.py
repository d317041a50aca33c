"""Two CPU ranks (gloo): sync points always pair, and planning on DDP / FSDP2 runs in lockstep.

* ranks at different sync points with tables of different widths raise
  ``RankDisagreementError`` on every rank (gloo aborted a process: the all-reduces differed
  in size), and a payload longer than the fixed first table still travels whole;
* ``runner.save()`` called on rank 0 only (it is collective) is ``RankDisagreementError`` on
  every rank, for a plain model and for DDP, whose bucket all-reduces share no group with the
  sync points any more (gloo aborted);
* ``objective="throughput"`` on a DDP and an FSDP2 model, with rank 1 slower on small
  micro-batches and out of memory timing one candidate: both ranks time the same candidates
  the same number of steps and record the same numbers (it aborted or hung);
* the planner's accumulated probe on DDP / FSDP2 answers for two micro-batches, not one;
* ``micro_batch=None`` with an empty stream on rank 1: ``UnevenDataError`` on every rank.

All scenarios share one launch of ``lockstep_worker.py`` (``launcher.shared_launch``) under a
hard timeout; the save scenarios come last (they leave the ranks' sync points unpaired).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import shared_launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "lockstep_worker.py"
SCENARIOS = ["widths", "throughput_ddp", "throughput_fsdp", "accumulated_ddp", "accumulated_fsdp", "empty_rank",
             "save_plain", "save_ddp"]


def reports_of(tmp_path_factory, scenario: str) -> list[dict]:
    runs, _ = shared_launch(tmp_path_factory, "lockstep", WORKER, SCENARIOS, SYNC_TIMEOUT="30")
    return runs[scenario]


def test_sync_points_of_different_widths_raise_on_every_rank(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "widths")
    for rank, report in enumerate(reports):
        assert report["long"] == [list(range(0, 30)), list(range(100, 130))]
        assert "different sync points" in report["error"], report["error"]
        assert f"sync point {'AB'[rank]}' but the ranks reached different sync points" in report["error"]
        assert report["after"] == [[0], [1]]  # the ranks pair again


@pytest.mark.parametrize("kind", ["plain", "ddp"])
def test_save_on_rank_zero_only_is_a_rank_disagreement_on_every_rank(tmp_path_factory, kind):
    reports = reports_of(tmp_path_factory, f"save_{kind}")
    for rank, report in enumerate(reports):
        assert report["error"] is not None, (rank, report)
    assert "checkpoint" in reports[0]["error"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_throughput_planning_times_the_same_candidates_on_every_rank(tmp_path_factory, kind):
    reports = reports_of(tmp_path_factory, f"throughput_{kind}")
    assert reports[0]["candidates"] == reports[1]["candidates"]  # same steps, same agreed times
    assert reports[0]["micro_batch"] == reports[1]["micro_batch"]
    by_micro = {c[0]: c for c in reports[0]["candidates"]}
    assert by_micro[8][2] and by_micro[8][5] is None  # out of memory on rank 1 only: failed everywhere
    assert by_micro[2][3] and len(by_micro[2][4]) == 2  # slow on rank 1 (16 sleeps a step): pruned on every rank, after 2 steps
    assert reports[0]["micro_batch"] != 8 and reports[0]["steps"] == reports[1]["steps"] == 2


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_accumulated_probe_keeps_accumulating_under_ddp_and_fsdp(tmp_path_factory, kind):
    reports = reports_of(tmp_path_factory, f"accumulated_{kind}")
    for report in reports:  # two micro-batches per optimizer step (it was one: the one-batch step)
        assert report["accumulated_passes"] == [2] and report["one_passes"] == [1], report
    assert reports[0]["accumulated"] == reports[1]["accumulated"] and reports[0]["one"] == reports[1]["one"]
    if kind == "ddp":  # the first micro-batch's gradients, held through the second, cost samples
        assert reports[0]["accumulated"] < reports[0]["one"], reports[0]


def test_an_empty_stream_on_one_rank_before_planning_is_uneven_data_on_every_rank(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "empty_rank")
    for report in reports:
        assert report["error"] is not None and "the data of rank 1 ran out after 0 batches" in report["error"]
    assert reports[0]["error"] == reports[1]["error"]
