"""One launcher for the multi-process tests: start the ranks of a worker, under a hard timeout.

* :func:`launch` starts ``world`` processes of a worker script (``distributed_worker.py``,
  ``fsdp_worker.py``; their shared main is ``rank_worker.py``) with the launcher's
  environment variables, waits at most ``timeout`` seconds (a hang kills them and fails the
  test), and returns every rank's report of every scenario, failing on a crash.
* :func:`shared_launch` runs several scenarios in **one** launch (each launch costs ~15 s of
  imports and start-up on a 2-core machine) and shares the reports between the tests that
  read them, also across pytest-xdist workers: the first test to ask runs the launch under a
  file lock and the others read its reports.
* :func:`torchrun` runs ``python -m torch.distributed.run --nproc-per-node 2 -m autobatch ...``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import cli_env

__all__ = ["free_port", "launch", "shared_launch", "stop_runs", "torchrun", "TIMEOUT_S"]

TIMEOUT_S = 240  # a loaded 2-core machine; a hang fails here instead of blocking


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reports(out: Path, scenario: str, world: int, logs: list[str]) -> list[dict]:
    reports = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"{scenario}: rank {rank} wrote no report; its output:\n{logs[rank][-3000:]}"
        report = json.loads(path.read_text())
        assert "crash" not in report, f"{scenario}: rank {rank} crashed:\n{report['crash']}"
        reports.append(report)
    return reports


def launch(worker: Path, scenarios: str | list[str], out: Path, world: int = 2, timeout: float = TIMEOUT_S, **env: str):
    """Run ``scenarios`` of ``worker`` on ``world`` ranks. One scenario (a string): every rank's
    report; a list: ``{scenario: reports}``. Fails (killing the ranks) on a hang or a crash."""
    names = [scenarios] if isinstance(scenarios, str) else list(scenarios)
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), ",".join(names) + ("" if isinstance(scenarios, str) else ","), str(out)],
            env=cli_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
            process.wait()
        pytest.fail(f"{','.join(names)}: the ranks did not finish within {timeout} s (a hang)")
    if isinstance(scenarios, str):
        return _reports(out, scenarios, world, logs)
    return {name: _reports(out / name, name, world, logs) for name in names}


def shared_launch(tmp_path_factory, key: str, worker: Path, scenarios: list[str], **env: str) -> tuple[dict[str, list[dict]], Path]:
    """``launch(worker, scenarios, ...)`` once per test session (``key`` names it), shared by
    every test (and xdist worker) that asks: ``({scenario: reports}, directory)``, scenario
    ``s`` having written into ``directory / s``. A failed launch fails every test that asks."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-gw") else root  # shared by the xdist workers
    out, done = root / key, root / f"{key}.json"
    with FileLock(str(root / f"{key}.lock")):
        if not done.exists():
            try:
                reports = launch(worker, scenarios, out, **env)
            except BaseException as exc:  # the failure, for the other tests that read it
                done.write_text(json.dumps({"failed": str(exc)[-6000:]}))
                raise
            done.write_text(json.dumps({"reports": reports}))
    saved = json.loads(done.read_text())
    if "failed" in saved:
        pytest.fail(f"the shared launch {key} failed:\n{saved['failed']}")
    return {name: saved["reports"][name] for name in scenarios}, out


def torchrun(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node 2 -m autobatch *args`` in ``cwd``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "autobatch", *args,
    ]  # fmt: skip
    try:
        return subprocess.run(command, cwd=cwd, env=env or cli_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun {' '.join(args[:1])} did not finish within {timeout} s (a hang)")


#: the scenarios of ``stop_review_worker.py`` (``test_stop_ranks.py``'s and ``test_stop_review.py``'s), one launch
STOP_SCENARIOS = ["stop_plain", "stop_ddp", "stop_fsdp", "last_step_in_forward", "last_step_in_hook", "unsized",
                  "unsized_epoch_end", "epoch_end", "oom_replay", "planned", "second_fit", "fsdp_oom"]


def stop_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every rank's report of every stop-request scenario, from the one launch both files share."""
    worker = Path(__file__).resolve().parent / "stop_review_worker.py"
    return shared_launch(tmp_path_factory, "stop", worker, STOP_SCENARIOS, SYNC_TIMEOUT="60")[0]
