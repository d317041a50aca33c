"""One rank of ``test_review15b_ddp_unused.py`` (gloo, CPU): a DDP model whose forward skips a parameter.

Run as ``python tests/distributed/review15b_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and teardown:
``rank_worker.py``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner, TrainStep, find_max_batch  # noqa: E402
from rank_worker import main  # noqa: E402


class Branch(nn.Module):
    """``a`` always; ``b`` only on the ranks in ``users`` (a data-dependent branch, a task head)."""

    def __init__(self, users: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 1).double(), nn.Linear(6, 1).double()
        self.uses_b = dist.get_rank() in users

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + (self.b(x) if self.uses_b else 0)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def make_batch(n: int):
    return torch.randn(n, 6, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64)


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def unused(rank: int, world: int, out: Path) -> dict:
    """For ``b`` used on no rank (``never``) and on rank 0 only (``rank0``), ``Runner.fit`` and
    ``find_max_batch`` (``probe``, rank 0 only) on ``DDP(model)`` with DDP's defaults: each rank's
    error, its time, whether the weights are the initial ones, and the same on every rank."""
    report = {}
    for case, users in (("never", ()), ("rank0", (0,)), ("probe", (0,))):
        model = DDP(Branch(users))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        began = time.monotonic()
        try:
            if case == "probe":
                find_max_batch(TrainStep(model, optimizer, loss_fn, make_batch), strategy="binary", memory_limit="1MiB",
                               max_batch=64, cache=False, estimate_first=False)
            else:
                Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=8, grow_after=None, progress=False,
                       log_every=None).fit([make_batch(8) for _ in range(2)])
            error, message = None, ""
        except Exception as exc:  # noqa: BLE001 - reported
            error, message = type(exc).__name__, str(exc)
        seconds = time.monotonic() - began
        mine = weights(model)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)  # the default group still pairs after the error
        report[case] = {"error": error, "message": message[:1500], "seconds": seconds,
                        "untouched": torch.equal(mine, weights(Branch(users))),
                        "same": all(torch.equal(every[0], other) for other in every)}
    dist.barrier()
    return report


def empty(rank: int, world: int, out: Path) -> dict:
    """Rank 1's second batch is empty (``Runner.fit`` on ``DDP(model)``): each rank's error and its
    time; the weights the same on every rank."""
    model = DDP(Branch((0, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [make_batch(8), make_batch(0 if rank == 1 else 8)]
    began = time.monotonic()
    try:
        Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=8, grow_after=None, progress=False,
               log_every=None).fit(data)
        error, message = None, ""
    except Exception as exc:  # noqa: BLE001 - reported
        error, message = type(exc).__name__, str(exc)
    mine = weights(model)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    dist.barrier()
    return {"error": error, "message": message[:1500], "seconds": time.monotonic() - began,
            "same": all(torch.equal(every[0], other) for other in every)}


class _Normed(nn.Module):
    """A BatchNorm model with a head that each rank uses on every other step (``find_unused_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b = nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.bn(self.a(x)))
        return self.b(hidden) if x[0, 0] > 0 else hidden.sum(1, keepdim=True)


def _same_buffers(model: DDP, world: int) -> bool:
    """Whether every rank holds the same BatchNorm statistics."""
    mine = torch.cat([model.module.bn.running_mean, model.module.bn.running_var])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every)


def local_configs(rank: int, world: int, out: Path) -> dict:
    """DDP options the runner trains through the local module, 2 steps each (each rank its own
    data): ``broadcast_buffers`` True and False (are the ranks' BatchNorm statistics then rank 0's,
    after the steps and after a second ``fit`` call's start?), and a user's ``fp16_compress_hook``
    (what the runner warns)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(10 + rank)
    data = [make_batch(8) for _ in range(2)]
    data[1][0][:, 0] = -data[1][0][:, 0].abs()  # the second step skips b on this rank
    data[0][0][:, 0] = data[0][0][:, 0].abs()
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("autobatch").addHandler(handler)
    report = {}
    try:
        for case, options in (("broadcast", {}), ("own", dict(broadcast_buffers=False)), ("hook", {})):
            model = DDP(_Normed(), find_unused_parameters=case != "hook", **options)
            if case == "hook":
                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            warned.clear()
            runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=16,
                            micro_batch=8, grow_after=None, progress=False, log_every=None)
            runner.fit(data)
            report[case] = {"same_buffers": _same_buffers(model, world),
                            "warnings": [line for line in warned if "BatchNorm layers" not in line]}
            runner.fit(data, steps=2)  # a second fit() (nothing left to train): its start syncs the weights
            report[case]["same_after_refit"] = _same_buffers(model, world)
    finally:
        logging.getLogger("autobatch").removeHandler(handler)
    dist.barrier()
    return report


if __name__ == "__main__":
    main({"unused": unused, "empty": empty, "local_configs": local_configs})
