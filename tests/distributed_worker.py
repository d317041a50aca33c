"""One rank of the multi-process tests in ``test_distributed.py`` (gloo, CPU).

Run as ``python tests/distributed_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (``scripts/gpu_distributed.sh`` runs it
under ``torchrun`` with NCCL: ``BACKEND=nccl``). Start-up, reports (``rank<r>.json``, plus
weights files) and teardown: ``distributed/rank_worker.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))

from runner_workloads import hungry_mse, make_data, make_model, mse  # noqa: E402

from autobatch import Runner, TrainStep, find_max_batch, inject_oom  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from autobatch.errors import PeerFailedError, RankDisagreementError  # noqa: E402
from rank_worker import device, main  # noqa: E402

FAULT_PHASES = ("transfer", "forward", "backward", "optimizer")


def probe(rank: int, out: Path) -> dict:
    """Each rank probes under its own budget (``PROBE_LIMITS``, one per rank; on CUDA only
    when given, as a per-process cap), up to ``PROBE_MAX`` (default 256)."""
    limits = os.environ.get("PROBE_LIMITS", "3MiB,1536KiB").split(",")
    results = {}
    for strategy in ("binary", "auto"):
        model = make_model(width=16).to(device())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(0)

        def make_batch(size: int):
            x = torch.randn(size, 6, generator=generator, dtype=torch.float64)
            return (x.to(device()), torch.zeros(size, 1, dtype=torch.float64, device=device()))

        step = TrainStep(model, optimizer, hungry_mse, make_batch)
        limit = limits[rank % len(limits)] if device().type == "cpu" or "PROBE_LIMITS" in os.environ else None
        largest = int(os.environ.get("PROBE_MAX", "256"))
        result = find_max_batch(step, strategy=strategy, memory_limit=limit, steps_per_trial=1, max_batch=largest, cache=False)
        results[strategy] = {"batch_size": result.batch_size, "trials": [t.batch_size for t in result.trials]}
    return results


def ddp_probe(rank: int, world: int, out: Path) -> dict:
    """The probe through DDP (the real DDP step) under each rank's budget, vs its local module."""
    limits = os.environ.get("PROBE_LIMITS", "3MiB,1536KiB").split(",")
    limit = limits[rank % len(limits)]
    answers = {}
    for wrapped in (True, False):
        model = make_model(width=16).to(device())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(0)

        def make_batch(size: int):
            return (torch.randn(size, 6, generator=generator, dtype=torch.float64), torch.zeros(size, 1, dtype=torch.float64))

        step = TrainStep(ddp if wrapped else model, optimizer, hungry_mse, make_batch)
        result = find_max_batch(step, strategy="binary", memory_limit=limit, steps_per_trial=2, max_batch=256, cache=False)
        answers["ddp" if wrapped else "local"] = {"batch_size": result.batch_size, "trials": [t.batch_size for t in result.trials]}
    answers["trained"] = _ddp_answer_trains(rank, world)
    return answers


def _ddp_answer_trains(rank: int, world: int) -> dict:
    """Parameters as large as the activations: DDP's gradient buckets (and their rebuild after
    the first step) take room the local module's step does not; the DDP probe's answer must
    train through DDP under the same budget with no recovery."""
    from autobatch import simulated_memory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters())

    def loss_fn(module, batch):
        return torch.nn.functional.cross_entropy(module(batch[0]), batch[1])

    def make_batch(size: int):
        return torch.randn(size, 32), torch.randint(0, 10, (size,))

    answer = find_max_batch(TrainStep(ddp, optimizer, loss_fn, make_batch), memory_limit="4MiB", cache=False).batch_size
    generator = torch.Generator().manual_seed(3 + rank)
    data = [(torch.randn(answer, 32, generator=generator), torch.randint(0, 10, (answer,), generator=generator)) for _ in range(4)]
    with simulated_memory("4MiB"):
        runner = Runner(ddp, optimizer, loss_fn, global_batch=answer * world, micro_batch=answer, grow_after=None,
                        progress=False, log_every=None)
        result = runner.fit(data)
    return {"answer": answer, "recoveries": result.oom_recoveries}


def ddp_squeeze(rank: int, world: int, out: Path) -> dict:
    """Probe the DDP step under 3 MiB per rank and train at the answer; after step 2 rank 1
    loses 5 % of its budget for good: both ranks replay the step at one agreed micro-batch
    sized from rank 1's measurement (not halved), and every sample trains once."""
    from autobatch import simulated_memory

    budget = "3MiB"
    model = make_model(width=16).to(device())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int):
        return (torch.randn(size, 6, generator=generator, dtype=torch.float64), torch.zeros(size, 1, dtype=torch.float64))

    answer = find_max_batch(TrainStep(ddp, optimizer, hungry_mse, make_batch), strategy="binary", memory_limit=budget,
                            steps_per_trial=2, max_batch=256, cache=False).batch_size
    steps = 5
    data = [_share(batch, rank, world) for batch in make_data(answer * world * steps, answer * world)]
    squeeze: list[torch.Tensor] = []
    with simulated_memory(budget) as memory:

        def on_step_end(info):
            if info["step"] == 2 and rank == 1:
                squeeze.append(torch.empty(memory.limit_bytes // 20, dtype=torch.uint8))

        runner = Runner(ddp, optimizer, hungry_mse, global_batch=answer * world, micro_batch=answer, grow_after=None,
                        progress=False, log_every=None)
        result = runner.fit(data, on_step_end=on_step_end)
    return {"answer": answer, "recoveries": result.oom_recoveries, "samples": result.samples, "steps": result.steps,
            "micro_batch": result.micro_batch}


def _share(batch, rank: int, world: int):
    size = batch[0].shape[0] // world
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def train(rank: int, world: int, out: Path, phase: str | None, wrap: bool = True) -> dict:
    """3 steps of global batch 16 (8 per rank, micro-batch 4); an OOM on rank 1 only at step 1."""
    model = make_model(width=16).to(device())
    if wrap:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = [tuple(t.to(device()) for t in _share(batch, rank, world)) for batch in make_data(48, 16)]
    runner = Runner(model, optimizer, mse, global_batch=16, micro_batch=4, grow_after=None, progress=False, log_every=None)
    if phase is not None and rank == 1:
        inject_oom(runner, at=(1, phase))
    result = runner.fit(data)
    local = runner._train_step.model
    name = f"weights_{phase or 'none'}_rank{rank}.pt"
    torch.save([p.detach().cpu() for p in local.parameters()], out / name)
    return {
        "weights": name,
        "recoveries": result.oom_recoveries,
        "micro_batch": result.micro_batch,
        "samples": result.samples,
        "loss": result.last_loss,
    }


def _arm_backward_oom(model: torch.nn.Module, step_of: callable, at_step: int) -> dict:
    """Raise an OOM from *inside* the backward of the last micro-batch of ``at_step`` (once):
    a hook on the first layer's weight gradient, which autograd computes last, so DDP has
    launched the later layers' buckets (one parameter per bucket) when it fires."""
    first = next(model.parameters())
    state = {"fired": False}

    def hook(grad):
        if not state["fired"] and step_of() == at_step and torch.is_grad_enabled() is not None and model.require_backward_grad_sync:
            from autobatch.dist.ddp_step import ledger_for

            state["fired"] = True
            state["launched"] = list(ledger_for(model).launched)  # buckets in flight when it struck
            raise torch.OutOfMemoryError("CUDA out of memory (injected inside backward, buckets in flight)")
        return grad

    first.register_hook(hook)
    return state


def ddp_train(rank: int, world: int, out: Path, phase: str | None) -> dict:
    """As :func:`train`, through DDP with one bucket per parameter; ``phase="last_backward"``
    raises on rank 1 from inside the last micro-batch's backward at step 1."""
    model = torch.nn.parallel.DistributedDataParallel(make_model(width=16).to(device()), bucket_cap_mb=1e-6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = [tuple(t.to(device()) for t in _share(batch, rank, world)) for batch in make_data(48, 16)]
    runner = Runner(model, optimizer, mse, global_batch=16, micro_batch=4, grow_after=None, progress=False, log_every=None)
    assert runner._train_step.model is model  # trained through DDP itself
    armed = {}
    if phase == "last_backward" and rank == 1:
        armed = _arm_backward_oom(model, lambda: runner.step, 1)
    elif phase is not None and rank == 1:
        inject_oom(runner, at=(1, phase))
    result = runner.fit(data)
    name = f"ddp_weights_{phase or 'none'}_rank{rank}.pt"
    torch.save([p.detach().cpu() for p in model.parameters()], out / name)
    buckets = len(model.reducer._get_zeros_like_grad_buckets())
    return {"weights": name, "recoveries": result.oom_recoveries, "micro_batch": result.micro_batch,
            "samples": result.samples, "loss": result.last_loss, "buckets": buckets,
            "launched_at_failure": armed.get("launched")}


def ddp_faults(rank: int, world: int, out: Path) -> dict:
    phases = os.environ.get("DDP_PHASES", "none,last_backward,optimizer").split(",")
    return {phase: ddp_train(rank, world, out, None if phase == "none" else phase) for phase in phases}


def ddp_stalled(rank: int, world: int, out: Path) -> dict:
    """Rank 1 trains two steps through DDP, then never comes back: rank 0 must end in a clear
    error within the deadline (it is inside DDP's bucket all-reduce), not hang."""
    dist_sync.set_timeout(float(os.environ.get("SYNC_TIMEOUT", "3")))
    model = torch.nn.parallel.DistributedDataParallel(make_model(width=16).to(device()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [_share(batch, rank, world) for batch in make_data(48, 16)]
    runner = Runner(model, optimizer, mse, global_batch=16, micro_batch=4, grow_after=None, progress=False, log_every=None)
    class Leave(BaseException):  # not an Exception: on_step_end's errors are carried to every rank, not this
        pass

    def leave(info: dict) -> None:
        if rank == 1 and info["step"] == 2:
            raise Leave  # fit()'s arguments are the same on every rank (agreed); rank 1 just stops coming

    done = out / "ddp_stalled.rank0-done"  # rank 0 has its outcome: rank 1 may go
    try:
        # rank 1 leaves after step 2 (after the bucket rebuild): rank 0 waits inside backward
        runner.fit(data, on_step_end=leave)
    except RankDisagreementError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    except Leave:
        pass
    finally:
        if rank == 0:
            done.touch()
    # rank 1 stays alive (an exited peer closes its sockets, which gloo notices at once) until rank
    # 0 ended, capped where rank 0 would have waited out two deadlines and more
    limit = time.monotonic() + dist_sync.timeout() * 2 + 6
    while rank == 1 and not done.exists() and time.monotonic() < limit:
        time.sleep(0.05)
    return {"error": None}


def faults(rank: int, world: int, out: Path) -> dict:
    return {phase or "none": train(rank, world, out, phase) for phase in (None, *FAULT_PHASES)}


def peer_error(rank: int, world: int, out: Path) -> dict:
    """Rank 1's loss raises a ValueError at step 1: rank 1 sees it, rank 0 a PeerFailedError."""
    model = make_model().to(device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [_share(batch, rank, world) for batch in make_data(48, 16)]
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:
            raise ValueError("a bug in rank 1's loss")
        return mse(m, batch)

    runner = Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=4, grow_after=None, progress=False, log_every=None)
    try:
        runner.fit(data)
    except (ValueError, PeerFailedError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def skipped_sync(rank: int, world: int, out: Path) -> dict:
    """Rank 1 never reaches the sync point; rank 0 must time out with a clear error."""
    dist_sync.set_timeout(float(os.environ.get("SYNC_TIMEOUT", "3")))
    done = out / "skipped_sync.rank0-done"
    if rank == 1:  # alive (not at the sync point) until rank 0 has its outcome, at most a deadline and more
        limit = time.monotonic() + dist_sync.timeout() + 4
        while not done.exists() and time.monotonic() < limit:
            time.sleep(0.05)
        return {"error": None}
    try:
        dist_sync.agree(True, "the sync rank 1 skips")
    except RankDisagreementError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        done.touch()
    return {"error": None}


def mismatched(rank: int, world: int, out: Path) -> dict:
    """The ranks reach different sync points: both raise at once."""
    try:
        dist_sync.agree(True, f"sync point {'A' if rank == 0 else 'B'}")
    except RankDisagreementError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def ddp_resume(rank: int, world: int, out: Path) -> dict:
    """Dropout seeded per rank through DDP: 4 steps at once, and 2 steps then a resume to 4,
    end with the same weights on each rank (each rank's random state is in the checkpoint)."""
    final = {}
    for name, stop, resume in (("whole", None, None), ("half", 2, None), ("resumed", None, out / "ckpt_half")):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(make_model(width=16, dropout=0.3).to(device()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        torch.manual_seed(100 + rank)  # each rank its own masks, as training scripts seed
        data = [tuple(t.to(device()) for t in _share(batch, rank, world)) for batch in make_data(64, 16)]
        checkpoints = out / ("ckpt_whole" if name == "whole" else "ckpt_half")
        runner = Runner(model, optimizer, mse, global_batch=16, micro_batch=8, progress=False, log_every=None,
                        checkpoint_dir=checkpoints)
        runner.fit(data, steps=stop, resume=resume)
        final[name] = [p.detach().cpu().tolist() for p in runner._train_step.model.parameters()]
    return {"same": final["whole"] == final["resumed"], "moved": final["whole"] != final["half"]}


def ddp_sampler(rank: int, world: int, out: Path) -> dict:
    """A ``DistributedSampler(shuffle=True, drop_last=False)`` loader of 39 samples (padded to 40)
    through DDP: shares of 8, 8 and a short last 4 per rank, 2 epochs (the runner calls set_epoch)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    x, y, _ = make_data(39, 39)[0]
    loader = DataLoader(TensorDataset(x, y), batch_size=8, sampler=DistributedSampler(TensorDataset(x, y), seed=3))
    model = torch.nn.parallel.DistributedDataParallel(make_model(width=16).to(device()))
    runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), mse, global_batch=16, micro_batch=4,
                    grow_after=None, progress=False, log_every=None)
    result = runner.fit(loader, epochs=2)
    return {"weights": [p.detach().cpu().tolist() for p in model.parameters()], "samples": result.samples,
            "steps": result.steps, "loss": float(result.last_loss)}


SCENARIOS = {"ddp_sampler": ddp_sampler, "ddp_resume": ddp_resume, "probe": probe, "ddp_probe": ddp_probe, "ddp_squeeze": ddp_squeeze, "faults": faults, "ddp_faults": ddp_faults, "ddp_stalled": ddp_stalled, "peer_error": peer_error, "skipped_sync": skipped_sync, "mismatched": mismatched}


if __name__ == "__main__":
    main({**SCENARIOS, "probe": lambda rank, world, out: probe(rank, out)})
