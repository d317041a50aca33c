"""FSDP2 (``fully_shard``) on two CPU ranks (gloo): the probe agrees on the smaller budget's
answer and restores the sharded model exactly; an OOM on one rank inside forward, backward
(also inside a block, between FSDP's collectives, and inside FSDP's all-gather allocation) and
the optimizer step is recovered by both ranks, ending with the uninjected run's weights.

Each test starts two processes of ``fsdp_worker.py`` under a hard timeout: a hang fails it.
Weights are float64; a replay with a halved micro-batch differs only by summation order.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env

def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not _has_fsdp2(), reason="needs torch.distributed with FSDP2")

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
TIMEOUT_S = 240  # a loaded 2-core machine; a hang fails here instead of blocking


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(scenario: str, out: Path, **env: str) -> list[dict]:
    """Run ``scenario`` on two ranks; both reports, or fail (killing them) on a hang."""
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(out)],
            env=cli_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"{scenario}: the ranks did not finish within {TIMEOUT_S} s (a hang)")
    reports = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report; its output:\n{logs[rank][-3000:]}"
        report = json.loads(path.read_text())
        assert "crash" not in report, f"rank {rank} crashed:\n{report['crash']}"
        reports.append(report)
    return reports


def test_fsdp_probe_agrees_on_the_smaller_budget_and_restores_the_shards(tmp_path):
    reports = launch("probe", tmp_path, LIMITS="6MiB,3MiB;3MiB,3MiB")
    for report in reports:
        mixed, small = report["6MiB,3MiB"], report["3MiB,3MiB"]
        assert mixed["batch_size"] == small["batch_size"] > 1  # the smaller rank's answer
        assert mixed["restored"] and small["restored"]  # local shards and optimizer state bit-exact
    assert reports[0] == reports[1]


def test_fsdp_probe_survives_gpu_timings_settling_steps_and_background_snapshot(tmp_path):
    """Two GPU-only timings, made certain: the answer's confirmation runs extra steps while
    reserved memory grows, which differs between ranks (they must still run the same steps:
    each is a collective); the background snapshot copies while FSDP has the root's full
    parameters swapped in (it must copy the sharded ones)."""
    reports = launch("probe", tmp_path, LIMITS="6MiB,3MiB", SETTLE_SKEW="1", SNAPSHOT_IN_FORWARD="1")
    runs = [report["6MiB,3MiB"] for report in reports]
    assert runs[0] == runs[1] and runs[0]["restored"]
    assert runs[0]["steps"][-1] == 2  # rank 0 grew, so both ran the extra step


FAULTS = "none,forward,backward,optimizer,inside:block_backward,inside:all_gather"


@pytest.mark.parametrize("reset", ["torch", "backport"])
def test_fsdp_one_rank_oom_anywhere_is_recovered_by_both_with_the_uninjected_weights(tmp_path, reset):
    """``backport``: FSDP's state is reset as on torch < 2.13, which has no ``reset_iter_state``
    (the GPU image's torch 2.11; a plain ``reshard()`` there left the root unsharded)."""
    reports = launch("train", tmp_path, FAULTS=FAULTS, **({"TORCH_211_RESET": "1"} if reset == "backport" else {}))
    for rank, report in enumerate(reports):
        reference = report["none"]
        assert reference["recoveries"] == []
        for fault in FAULTS.split(",")[1:]:
            run = report[fault]
            assert len(run["recoveries"]) == 1, (rank, fault, run["recoveries"])
            assert run["recoveries"][0]["step"] == 1 and run["micro_batch"] == 2
            assert run["steps"] == reference["steps"] == 2
            for name, values in reference["shards"].items():
                torch.testing.assert_close(torch.tensor(run["shards"][name]), torch.tensor(values), rtol=1e-10, atol=1e-12, msg=f"{fault}: {name}")
    for fault in FAULTS.split(","):  # both ranks report the same global loss
        assert reports[0][fault]["loss"] == pytest.approx(reports[1][fault]["loss"], rel=1e-12)
