"""What every rank process of the multi-process tests shares (``distributed_worker.py``, ``fsdp_worker.py``).

A worker script defines its scenarios (functions ``(rank, world, out) -> dict``) and calls
:func:`main`. Run as ``python WORKER SCENARIO[,SCENARIO...] OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (or under ``torchrun``). One scenario
writes ``OUT_DIR/rank<r>.json``; several run one after the other in the same process group
(one launch: the imports and the group's start-up are paid once) and write
``OUT_DIR/<scenario>/rank<r>.json`` each (a trailing comma, ``SCENARIO,``, asks for that
layout with one). A scenario that raises is reported as ``{"crash":
traceback}`` and ends the launch (the process group may be unusable after it). The process
exits with ``os._exit`` so a broken process group cannot stall the teardown.

Environment: ``BACKEND`` (gloo; ``nccl`` puts rank r on GPU ``LOCAL_RANK``), ``SYNC_TIMEOUT``
(autobatch's sync deadline, when given; the gloo group's own timeout is 2 s longer),
``TORCH_211_RESET=1`` (FSDP's state reset as on torch < 2.13, without ``reset_iter_state``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autobatch import distributed as dist_sync  # noqa: E402

Scenario = Callable[[int, int, Path], dict]


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _init() -> None:
    backend = os.environ.get("BACKEND", "gloo")
    if backend == "nccl":  # eager communicator set-up, as autobatch.distributed.init_from_env does
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        dist.init_process_group(backend, device_id=local)
    else:  # the default group's timeout bounds the collectives of DDP and FSDP (2 s after
        # autobatch's own deadline, so the tests of that deadline see autobatch's error)
        dist.init_process_group(backend, timeout=timedelta(seconds=float(os.environ.get("SYNC_TIMEOUT", "300")) + 2))
    if os.environ.get("TORCH_211_RESET"):  # recover FSDP as on torch < 2.13 (no FSDPModule.reset_iter_state)
        from torch.distributed.fsdp import FSDPModule

        if hasattr(FSDPModule, "reset_iter_state"):
            del FSDPModule.reset_iter_state
    group = dist_sync.control_group()  # while every rank is here, as init_from_env does
    assert group is not None and group is not dist.group.WORLD  # sync points never share the default group
    if "SYNC_TIMEOUT" in os.environ:
        dist_sync.set_timeout(float(os.environ["SYNC_TIMEOUT"]))


def main(scenarios: dict[str, Scenario]) -> None:
    """Run the scenarios named in ``sys.argv[1]`` (comma-separated) on this rank; see the module."""
    names, out = [name for name in sys.argv[1].split(",") if name], Path(sys.argv[2])
    nested = "," in sys.argv[1]  # a list (``a,b``; ``a,`` for one): a directory per scenario
    out.mkdir(parents=True, exist_ok=True)
    _init()
    rank, world = dist.get_rank(), dist.get_world_size()
    code = 0
    for name in names:
        where = out / name if nested else out
        where.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        try:
            report = scenarios[name](rank, world, where)
        except BaseException:  # noqa: BLE001 - reported to the parent test
            report, code = {"crash": traceback.format_exc()}, 1
        (where / f"rank{rank}.json").write_text(json.dumps(report, default=str), encoding="utf-8")
        if os.environ.get("AUTOBATCH_TEST_TIMES"):  # where a shared launch's time goes (trimming CI)
            with open(os.environ["AUTOBATCH_TEST_TIMES"], "a", encoding="utf-8") as times:
                times.write(f"{Path(sys.argv[0]).name} rank{rank} {name} {time.perf_counter() - started:.2f}\n")
        if code:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
