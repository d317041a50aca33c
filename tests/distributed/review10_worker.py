"""One rank of the ``test_review10_*.py`` tests (gloo, CPU): scenarios of the tenth review.

Run as ``python tests/distributed/review10_worker.py SCENARIO OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and teardown:
``rank_worker.py``. Each scenario that leaves the ranks out of step runs in a launch of its own.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from rank_worker import main  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)


def _sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _data(rank: int, steps: int = 2):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16 * steps, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(16 * steps, 1, generator=generator, dtype=torch.float64)
    return [(x[i + rank * 8 : i + rank * 8 + 8], y[i + rank * 8 : i + rank * 8 + 8]) for i in range(0, 16 * steps, 16)]


def fsdp_stalled(rank: int, world: int, out: Path) -> dict:
    """Rank 1 stalls in its loss function at step 1 (user code that never reaches FSDP's next
    collective) for three sync deadlines; rank 0 waits at the vote before its first all-gather.
    Reports how long rank 0 took to raise, and what."""
    limit = dist_sync.timeout()
    model = _sharded()
    done = out / "fsdp_stalled.rank0-done"

    def loss_fn(net, batch):
        if rank == 1 and runner.step == 1:  # stalled until rank 0 has its outcome, at most three deadlines
            stop = time.monotonic() + 3 * limit
            while not done.exists() and time.monotonic() < stop:
                time.sleep(0.05)
        return nn.functional.mse_loss(net(batch[0]), batch[1])

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn, global_batch=16, micro_batch=8, **QUIET)
    began = time.monotonic()
    try:
        runner.fit(_data(rank))
        error, message = None, ""
    except BaseException as exc:  # noqa: BLE001 - reported
        error, message = type(exc).__name__, str(exc)
    seconds = time.monotonic() - began
    if rank == 0:
        done.touch()
    return {"error": error, "message": message[:2000], "seconds": seconds, "limit": limit}


def checkpoint_on_rank_zero(rank: int, world: int, out: Path) -> dict:
    """``checkpoint_dir`` on rank 0 only (the habit of saving on rank 0): one error on every rank
    before any step, naming the argument, instead of a hang at the first save."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.01), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                    global_batch=16, micro_batch=8, checkpoint_dir=out / "ckpt" if rank == 0 else None, **QUIET)
    began = time.monotonic()
    try:
        runner.fit(_data(rank), steps=2 if rank == 0 else None)
        error, message = None, ""
    except BaseException as exc:  # noqa: BLE001 - reported
        error, message = type(exc).__name__, str(exc)
    return {"error": error, "message": message[:2000], "seconds": time.monotonic() - began, "step": runner.step,
            "written": (out / "ckpt").exists() and any((out / "ckpt").iterdir())}


SCENARIOS = {"fsdp_stalled": fsdp_stalled, "checkpoint_on_rank_zero": checkpoint_on_rank_zero}

if __name__ == "__main__":
    main(SCENARIOS)
