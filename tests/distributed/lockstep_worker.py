"""One rank of ``test_lockstep.py`` (gloo, CPU): sync points that pair, planning in lockstep.

Run as ``python tests/distributed/lockstep_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and
teardown: ``rank_worker.py``. Each scenario catches only the error it expects; any other is
reported as a crash (and a gloo abort leaves no report): both fail the test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]

import autobatch.planning.throughput as throughput  # noqa: E402
from autobatch import Runner, TrainStep, UnevenDataError, find_max_batch  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from autobatch.errors import RankDisagreementError  # noqa: E402
from autobatch.planning.accumulation import AccumulatingStep  # noqa: E402
from rank_worker import main  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)
LIMIT = "2MiB"  # the accumulated probes: one-step answers near 160, below their max_batch


def _batches(samples: int, global_batch: int, rank: int, world: int):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(samples, 1, generator=generator, dtype=torch.float64)
    share = global_batch // world
    return [(x[i + rank * share : i + (rank + 1) * share], y[i + rank * share : i + (rank + 1) * share])
            for i in range(0, samples, global_batch)]


def _mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _model(kind: str, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)).double()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist_sync.world_size(),)))
    return model


def widths(rank: int, world: int, out: Path) -> dict:
    """A payload longer than the fixed first table; then ranks at different sync points whose
    tables differ in width (gloo aborted the process: sizes of the all-reduce differed); then
    the ranks pair again."""
    long = dist_sync.exchange(list(range(100 * rank, 100 * rank + 30)), "a long payload")
    try:
        dist_sync.exchange([1] if rank == 0 else [1, 2, 3], f"sync point {'A' if rank == 0 else 'B'}")
        error = None
    except RankDisagreementError as exc:
        error = str(exc)
    return {"long": long, "error": error, "after": dist_sync.exchange([rank], "after the disagreement")}


def _throughput(rank: int, kind: str) -> dict:
    """The runner plans with objective="throughput" on a DDP / FSDP2 model. Rank 1 is slower
    on small micro-batches (as a busier host is: it alone pruned them) and runs out of memory
    timing micro-batch 8 (its peer went on into the next collective alone)."""
    timing = [False]
    inner = throughput._time

    def flagged(*args, **kwargs):
        timing[0] = True
        try:
            return inner(*args, **kwargs)
        finally:
            timing[0] = False

    def loss_fn(model, batch):
        size = batch[0].shape[0]
        if rank == 1 and timing[0] and size == 8:
            raise torch.OutOfMemoryError("Simulated out of memory: rank 1 timing micro-batch 8")
        if rank == 1 and size <= 4:
            time.sleep(0.01)
        return _mse(model, batch)

    model = _model(kind)
    runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), loss_fn, global_batch=64, micro_batch=None,
                    plan_options={"objective": "throughput", "max_batch": 16, "min_micro_batch": 2, "warmup_steps": 1,
                                  "timed_steps": 3, "retime_rounds": 1},
                    **QUIET)
    throughput._time = flagged
    try:
        result = runner.fit(_batches(128, 64, rank, 2))
    finally:
        throughput._time = inner
    candidates = [[c["micro_batch"], c["accumulation_steps"], c["error"] is not None, c["pruned"], c["step_seconds"],
                   c["samples_per_s"]] for c in result.plan["candidates"]]
    return {"micro_batch": result.micro_batch, "steps": result.steps, "candidates": candidates}


def throughput_ddp(rank: int, world: int, out: Path) -> dict:
    return _throughput(rank, "ddp")


def throughput_fsdp(rank: int, world: int, out: Path) -> dict:
    return _throughput(rank, "fsdp")


def _accumulated(rank: int, kind: str) -> dict:
    """The planner's accumulated probe on a DDP / FSDP2 model steps the optimizer once per two
    micro-batches (the first one's gradients held through the second), and answers for that,
    not for the one-batch step. ``passes``: the loss calls before each optimizer step."""
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int):
        return (torch.randn(size, 6, generator=generator, dtype=torch.float64), torch.zeros(size, 1, dtype=torch.float64))

    report = {}
    for name, wrap in (("one", lambda step: step), ("accumulated", AccumulatingStep)):
        model = _model(kind, width=256)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        pending, passes = [0], set()
        zero_grad = optimizer.zero_grad

        def zeroed(*args, zero_grad=zero_grad, pending=pending, **kwargs):  # a step begins (or ended)
            pending[0] = 0
            return zero_grad(*args, **kwargs)

        def loss_fn(model, batch, pending=pending):
            pending[0] += 1
            return _mse(model, batch)

        optimizer.zero_grad = zeroed
        optimizer.register_step_pre_hook(lambda *_, pending=pending, passes=passes: passes.add(pending[0]))
        step = TrainStep(model, optimizer, loss_fn, make_batch)
        report[name] = find_max_batch(wrap(step), strategy="binary", start=8, memory_limit=LIMIT, steps_per_trial=1,
                                      max_batch=256, cache=False).batch_size
        report[f"{name}_passes"] = sorted(passes)
    return report


def accumulated_ddp(rank: int, world: int, out: Path) -> dict:
    return _accumulated(rank, "ddp")


def accumulated_fsdp(rank: int, world: int, out: Path) -> dict:
    return _accumulated(rank, "fsdp")


class _Stream:
    """Re-iterable batches without a length; empty on rank 1."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def empty_rank(rank: int, world: int, out: Path) -> dict:
    """micro_batch=None (planned on the first batch) and rank 1's stream is empty: one
    UnevenDataError on every rank (rank 1 raised ValueError, rank 0 waited or disagreed)."""
    model = _model("ddp")
    runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), _mse, global_batch=16, micro_batch=None,
                    plan_options={"memory_limit": "8MiB"}, **QUIET)
    try:
        runner.fit(_Stream(_batches(64, 16, rank, 2) if rank == 0 else []))
    except UnevenDataError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _save_on_rank_zero(rank: int, kind: str, out: Path) -> dict:
    """``if rank == 0: runner.save()`` inside ``on_step_end`` (save is collective): rank 0 waits
    at the checkpoint's sync point while rank 1 goes on to the next step."""
    model = _model(kind)
    runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), _mse, global_batch=16, micro_batch=4, **QUIET)

    def on_step_end(info):
        if info["step"] == 2 and rank == 0:
            runner.save(out / f"{kind}.pt")

    began = time.perf_counter()
    try:
        runner.fit(_batches(64, 16, rank, 2), on_step_end=on_step_end)
    except RankDisagreementError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - began}
    return {"error": None}


def save_plain(rank: int, world: int, out: Path) -> dict:
    return _save_on_rank_zero(rank, "plain", out)


def save_ddp(rank: int, world: int, out: Path) -> dict:
    """Last in a launch: rank 1 is left in DDP's bucket all-reduce (the default group), which
    ends when rank 0 leaves; the ranks' sync points no longer pair after it."""
    dist_sync.set_timeout(3)
    return _save_on_rank_zero(rank, "ddp", out)


SCENARIOS = {
    "widths": widths, "throughput_ddp": throughput_ddp, "throughput_fsdp": throughput_fsdp,
    "accumulated_ddp": accumulated_ddp, "accumulated_fsdp": accumulated_fsdp, "empty_rank": empty_rank,
    "save_plain": save_plain, "save_ddp": save_ddp,
}


if __name__ == "__main__":
    main(SCENARIOS)
