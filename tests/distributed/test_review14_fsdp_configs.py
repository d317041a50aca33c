"""Two CPU ranks (gloo): FSDP2 configured as real FSDP2 code does, in the runner and the probe.

* ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (bf16 all-gathers and
  fp32 reduce-scatters run on gloo), ``reshard_after_forward=False`` (ZeRO-2) and ``=1``, one
  ``fully_shard(model)`` on torch's default mesh, and a LoRA-like model (frozen bases and head in
  the sharded units) with ``max_grad_norm`` and an LR scheduler: a one-rank OOM at step 1 is
  replayed bit-equal to a run given the replay's micro-batches, and a sharded resume is bit-equal
  to the uninterrupted run.
* The probe under a different cap per rank agrees on one answer and restores the shards;
  ``Runner(micro_batch=None)`` plans a bf16 model with clipping and a scheduler on both ranks alike.
* A non-OOM error in a block's forward or backward hook on rank 1: rank 0 raises
  ``PeerFailedError`` naming it at its next vote (rank 1 then waits in a barrier no vote pairs with).
* An HSDP (2-D, replicate x shard) mesh is refused at ``Runner(...)`` on every rank: its gradient
  all-reduce is not voted on, and a one-rank OOM left the other rank in it until the sync deadline.

One launch for all (about 10 s on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import shared_launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = Path(__file__).resolve().parent / "review14_fsdp_worker.py"
SCENARIOS = ["configs", "probe_plan", "peer_error", "hsdp"]
KINDS = ["bf16", "zero2", "reshard_int", "root_only", "lora"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return shared_launch(tmp_path_factory, "review14_fsdp", WORKER, SCENARIOS, SYNC_TIMEOUT="30")[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_one_rank_oom_replays_and_a_resume_continues_bit_exactly(runs, kind):
    for rank, report in enumerate(runs["configs"]):
        got = report[kind]
        after = 8 if kind in ("reshard_int", "lora") else 4  # an optimizer-step OOM: the same micro-batch again
        assert got["recoveries"] == [[8, after]], (rank, got)
        assert got["replay_equal"] and got["resume_equal"] and got["trained"], (rank, got)
        assert got["lr"] == (1e-2 / 4 if kind == "lora" else 1e-2), (rank, got)  # the scheduler resumed at step 3


def test_the_probe_and_the_planner_agree_across_ranks(runs):
    rank0, rank1 = runs["probe_plan"]
    for kind in ("bf16", "zero2"):
        assert rank0[kind]["batch_size"] == rank1[kind]["batch_size"] > 1, (rank0, rank1)
        assert rank0[kind]["restored"] and rank1[kind]["restored"], (rank0, rank1)
    assert rank0["plan"] == rank1["plan"], (rank0, rank1)
    plan = rank0["plan"]
    assert plan["steps"] == 2 and plan["recoveries"] == [[plan["planned"], plan["planned"] // 2]], plan
    assert plan["lr"] == pytest.approx(1e-2 / 3), plan


@pytest.mark.parametrize("kind, hook", [("bf16", "register_forward_hook"), ("zero2", "register_full_backward_hook")])
def test_a_non_oom_error_inside_a_block_stops_the_peer_at_once(runs, kind, hook):
    rank0, rank1 = (report[kind] for report in runs["peer_error"])
    assert rank1["error"] == "ValueError", rank1
    assert rank0["error"] == "PeerFailedError" and f"ValueError: rank 1's {hook}" in rank0["message"], rank0
    assert rank0["seconds"] < 10, rank0  # its next vote, not the 30 s deadline


def test_an_hsdp_mesh_is_one_clear_error_on_every_rank(runs):
    for report in runs["hsdp"]:
        assert report["error"] == "ValueError", report
        assert "2-D mesh (2, 1)" in report["message"] and "init_device_mesh(device, (world_size,))" in report["message"], report
