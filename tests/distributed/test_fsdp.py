"""FSDP2 (``fully_shard``) on two CPU ranks (gloo): the probe agrees on the smaller budget's
answer and restores the sharded model exactly; an OOM on one rank inside forward, backward
(also inside a block, between FSDP's collectives, and inside FSDP's all-gather allocation) and
the optimizer step is recovered by both ranks, ending with the uninjected run's weights; a
run stopped and resumed from its per-rank sharded checkpoints ends bit-equal to an
uninterrupted one, and a resume under another world size is one clear error; the planner
checkpoints the sharded blocks where only that fits, and the planned run trains bit-equal to
the unwrapped one.

All scenarios run in one launch of two ``fsdp_worker.py`` processes (``launcher.shared_launch``)
under a hard timeout: a hang fails it. Weights are float64; a replay with a halved micro-batch
differs only by summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import shared_launch


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not _has_fsdp2(), reason="needs torch.distributed with FSDP2")

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
FAULTS = "none,forward,backward,optimizer,inside:block_backward,inside:all_gather"
SCENARIOS = ["probe", "train", "resume", "checkpointing", "clipped",
             "probe_as_on_gpu", "train_as_on_gpu"]  # last: they change the process (fsdp_worker._as_on_gpu)


def reports_of(tmp_path_factory, scenario: str) -> list[dict]:
    """Both ranks' reports of ``scenario``, from the one launch the tests of this file share."""
    runs, _ = shared_launch(tmp_path_factory, "fsdp", WORKER, SCENARIOS, LIMITS="6MiB,3MiB;3MiB,3MiB", FAULTS=FAULTS,
                            SYNC_TIMEOUT="60", CKPT_LIMIT="6MiB")
    return runs[scenario]


def test_fsdp_probe_agrees_on_the_smaller_budget_and_restores_the_shards(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "probe")
    for report in reports:
        mixed, small = report["6MiB,3MiB"], report["3MiB,3MiB"]
        assert mixed["batch_size"] == small["batch_size"] > 1  # the smaller rank's answer
        assert mixed["restored"] and small["restored"]  # local shards and optimizer state bit-exact
        # the estimate refuses in one line that says why and what to do instead
        assert mixed["estimate"].startswith("EstimateError: the model has DTensor parameters (FSDP2 fully_shard")
        assert "probe with real trials" in mixed["estimate"]
    assert reports[0] == reports[1]


def gpu_timings(tmp_path_factory, scenario: str) -> list[dict]:
    """Both ranks' reports of ``scenario`` run as on the GPU image (``fsdp_worker._as_on_gpu``:
    FSDP's state reset as on torch < 2.13, the answer's settling steps growing on rank 0 only, the
    probe's background snapshot copying while FSDP has the root's full parameters swapped in)."""
    return reports_of(tmp_path_factory, f"{scenario}_as_on_gpu")


def test_fsdp_probe_survives_gpu_timings_settling_steps_and_background_snapshot(tmp_path_factory):
    runs = [report["6MiB,3MiB"] for report in gpu_timings(tmp_path_factory, "probe")]
    assert runs[0] == runs[1] and runs[0]["restored"]
    assert runs[0]["steps"][-1] == 2  # rank 0 grew, so both ran the extra step


@pytest.mark.parametrize("reset", ["torch", "backport"])
def test_fsdp_one_rank_oom_anywhere_is_recovered_by_both_with_the_uninjected_weights(tmp_path_factory, reset):
    reports = reports_of(tmp_path_factory, "train") if reset == "torch" else gpu_timings(tmp_path_factory, "train")
    for rank, report in enumerate(reports):
        reference = report["none"]
        assert reference["recoveries"] == []
        for fault in FAULTS.split(",")[1:]:
            run = report[fault]
            assert len(run["recoveries"]) == 1, (rank, fault, run["recoveries"])
            same = run["recoveries"][0]["phase"] == "optimizer"  # the micro-batch does not size the optimizer step
            assert run["recoveries"][0]["step"] == 1 and run["micro_batch"] == (4 if same else 2)
            assert run["steps"] == reference["steps"] == 2
            for name, values in reference["shards"].items():
                torch.testing.assert_close(torch.tensor(run["shards"][name]), torch.tensor(values), rtol=1e-10, atol=1e-12, msg=f"{fault}: {name}")
    for fault in FAULTS.split(","):  # both ranks report the same global loss
        assert reports[0][fault]["loss"] == pytest.approx(reports[1][fault]["loss"], rel=1e-12)


def test_fsdp_sharded_checkpoints_resume_bit_exactly_and_only_under_the_same_world_size(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "resume")
    for rank, report in enumerate(reports):
        assert report["files"] == ["last.rank0-of-2.pt", "last.rank1-of-2.pt"]  # one file per rank, nothing else
        assert report["resumed_from"]["step"] == 2 and report["resumed_from"]["path"].endswith(f"last.rank{rank}-of-2.pt")
        assert report["checkpoint_path"].endswith("last.rank0-of-2.pt")
        assert report["resumed"].keys() == report["whole"].keys()
        for name, values in report["whole"].items():  # weights and AdamW moments of this rank's shards
            assert report["resumed"][name] == values, (rank, name)
        message = report["other_world"]  # the shards of a 4-rank job under 2 ranks: what to change
        assert "sharded over 4 ranks and this job has 2" in message and "torchrun --nproc-per-node 4" in message


def test_fsdp_the_planner_checkpoints_sharded_blocks_and_the_planned_run_trains_bit_equal(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "checkpointing")
    for rank, report in enumerate(reports):
        # class names find FSDP's FSDP<Name> subclasses; only with checkpointing does batch 8 fit
        assert report["blocks"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert report["plan"]["checkpointing"] and report["plan"]["micro_batch"] == 8, report["plan"]
        assert report["plan"]["modules"] == report["blocks"] and report["wrapped"] == [True, True, True]
        planned, plain = report["planned"], report["plain"]
        assert planned["steps"] == plain["steps"] == 3 and planned["recoveries"] == []
        # the recompute runs the same kernels on the same all-gathered weights: bit-equal
        assert planned["shards"] == plain["shards"], rank
        assert planned["loss"] == plain["loss"]


def test_fsdp_clips_the_global_gradient_norm_and_a_replay_clips_the_same(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "clipped")
    for rank, report in enumerate(reports):
        clipped, replayed, unclipped = report["clipped"], report["clipped_oom"], report["unclipped"]
        assert replayed["recoveries"] == 1 and clipped["recoveries"] == 0
        for name, values in clipped["shards"].items():
            torch.testing.assert_close(torch.tensor(replayed["shards"][name]), torch.tensor(values), rtol=1e-10, atol=1e-12)
        assert any(not torch.allclose(torch.tensor(unclipped["shards"][name]), torch.tensor(values))
                   for name, values in clipped["shards"].items()), rank
    assert reports[0]["clipped"]["loss"] == pytest.approx(reports[1]["clipped"]["loss"], rel=1e-12)
