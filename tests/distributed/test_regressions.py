"""Two CPU ranks (gloo): the distributed bugs an adversarial review found stay fixed.

* FSDP2, ranks whose shares split into different numbers of micro-batches: trained (it hung);
* FSDP2, an OOM on one rank before the model's first forward: recovered by both (an
  ``AttributeError`` from FSDP's reset hid it), in the runner and in the probe;
* FSDP2 with only the blocks sharded: the plain parameters stay equal across ranks (they
  drifted apart) and a one-rank OOM inside a block is recovered (it hung); clipping there is
  one clear error (torch's own failed mid-step);
* DDP with ``find_unused_parameters=True``: a parameter without a gradient on every rank is
  not stepped (weight decay moved it, AdamW made state for it);
* DDP after the runner: a plain backward gets DDP's own gradient (0.75x after a short last
  batch), and a model with a built-in comm hook trains (it raised "can only be called once");
* DDP over a sub-group, FSDP over a smaller mesh: one clear error (DDP's gradients were
  silently halved);
* the store-based votes leave nothing in the store: every row pushed is popped;
* healthy ranks at different FSDP collectives raise at once instead of pairing them;
* ``fit_batch_size`` over several processes counts the gradient buckets of the DDP ``train()`` wraps
  the model in (the unwrapped probe's answer ran out of memory in DDP's first step).

All scenarios share one launch of ``regressions_worker.py`` (``launcher.shared_launch``) under
a hard timeout; a hang fails it. Float64 weights, compared up to summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import shared_launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "regressions_worker.py"
SCENARIOS = ["hf_ddp", "mispaired", "store_keys", "fsdp_uneven", "fsdp_first_step_oom", "fsdp_partial", "ddp_unused", "ddp_hook",
             "subgroups"]


def reports_of(tmp_path_factory, scenario: str) -> list[dict]:
    """Both ranks' reports of ``scenario``, from the one launch the tests of this file share
    (a 30 s sync deadline: a rank left waiting fails the launch within it)."""
    runs, _ = shared_launch(tmp_path_factory, "regressions", WORKER, SCENARIOS, SYNC_TIMEOUT="30")
    return runs[scenario]


def assert_close(got: list[list[float]], expected: list[list[float]], what: str) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-10, atol=1e-12, msg=f"{what}: parameter {index}")


def test_fsdp_ranks_with_different_micro_batch_counts_train_the_global_mean(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "fsdp_uneven")
    for rank, report in enumerate(reports):
        assert report["samples"] == 48
        assert_close(report["weights"], report["reference"], f"rank {rank}")
        # rank 0 (6 samples: 2 micro-batches) ran one zero-weighted pass more; its forward's
        # buffer changes were put back, so its buffers (broadcast after each step) saw 3 x 6
        assert report["seen"] == 18.0


def test_fsdp_oom_before_the_first_forward_is_recovered_by_both_ranks(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "fsdp_first_step_oom")
    for rank, report in enumerate(reports):
        for where in ("transfer", "forward"):
            assert report[where]["recoveries"] == [[0, where]], (rank, where)
            assert_close(report[where]["weights"], report["reference"], f"rank {rank}, {where}")
    assert reports[0]["probe"] == reports[1]["probe"] == 32  # rank 1's first trial (64) failed before FSDP's lazy init


def test_fsdp_with_only_blocks_sharded_keeps_plain_parameters_in_step(tmp_path_factory):
    reports = reports_of(tmp_path_factory, "fsdp_partial")
    for rank, report in enumerate(reports):
        assert report["none"]["recoveries"] == 0 and report["block1_forward"]["recoveries"] == 1
        for fault in ("none", "block1_forward"):
            assert_close(report[fault]["weights"], report["reference"], f"rank {rank}, {fault}")
    assert reports[0]["none"]["weights"] == reports[1]["none"]["weights"]
    for report in reports:  # clipping sharded and plain gradients together: refused, saying what to change
        assert "fully_shard the root module too" in report["clipped"] and "max_grad_norm" in report["clipped"]


def test_ddp_unused_parameters_are_left_alone_as_ddp_does(tmp_path_factory):
    for report in reports_of(tmp_path_factory, "ddp_unused"):
        assert_close(report["runner"]["weights"], report["hand"]["weights"], "runner vs hand DDP")
        assert report["runner"]["unused_state"] == report["hand"]["unused_state"] == 0


def test_ddp_comm_hook_is_ddps_own_outside_the_runner_and_a_users_builtin_hook_trains(tmp_path_factory):
    for report in reports_of(tmp_path_factory, "ddp_hook"):
        assert report["ratio"] == pytest.approx(1.0, rel=1e-12)
        assert report["launched_after"] == 0  # nothing recorded outside autobatch's steps
        assert report["builtin"] == {"samples": 44}


def test_ddp_over_a_sub_group_or_fsdp_over_a_smaller_mesh_is_refused_with_what_to_change(tmp_path_factory):
    for report in reports_of(tmp_path_factory, "subgroups"):
        for where in ("runner", "probe"):
            ddp, fsdp = report["ddp"][where], report["fsdp"][where]
            assert ddp is not None and fsdp is not None, where
            assert "process group has 1 of the job's 2 ranks" in ddp and "process_group=None" in ddp
            assert "a mesh of 1 rank and the job has 2" in fsdp and "init_device_mesh" in fsdp


def test_store_votes_leave_nothing_in_the_store(tmp_path_factory):
    """Every row a vote pushes is popped: after 2 and after 8 steps (hundreds of votes) no row is
    queued and no per-vote key exists."""
    for report in reports_of(tmp_path_factory, "store_keys"):
        assert report["8"]["votes"] > report["2"]["votes"] > 10, report
        assert all(left["queued"] == 0 and left["keys"] == 0 for left in report.values()), report


def test_healthy_ranks_at_different_fsdp_collectives_raise_at_once(tmp_path_factory):
    for report in reports_of(tmp_path_factory, "mispaired"):
        assert report["settled"] and "different collectives" in report["error"]
        assert "before an all-gather" in report["error"] and "before a reduce-scatter" in report["error"]


def test_a_trainers_answer_over_processes_trains_in_the_ddp_train_wraps_it_in(tmp_path_factory):
    for report in reports_of(tmp_path_factory, "hf_ddp"):
        if "skipped" in report:
            pytest.skip(report["skipped"])
        assert report["bucket_bytes"] == report["parameter_bytes"], report
        assert report["trained"] and not report["above_trained"], report  # the exact maximum under DDP
