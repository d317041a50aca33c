"""One rank of the FSDP2 tests in ``test_fsdp.py`` (gloo, CPU; NCCL under torchrun with ``BACKEND=nccl``).

Run as ``python tests/distributed/fsdp_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. A tiny float64 GPT (autobatch's
built-in), each block and the root ``fully_shard`` -ed on a 1-D mesh, AdamW. Start-up, reports
and teardown: ``rank_worker.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner, TrainStep, find_max_batch  # noqa: E402
from autobatch.dist.fsdp_guard import _param_groups  # noqa: E402
from autobatch.training.oom.faults import FaultInjector  # noqa: E402
from autobatch.workloads.models import GPT  # noqa: E402
from rank_worker import device, main  # noqa: E402

VOCAB, SEQ = 32, 16


def build(width: int = 32, layers: int = 2):
    """The same initial model on every rank, sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, layers=layers, width=width, heads=4).double().to(device())
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def loss_fn(model, batch):
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def shards(model, optimizer) -> dict:
    """This rank's local shards of the weights and optimizer state, as lists."""
    out = {name: p.to_local().detach().cpu().reshape(-1).tolist() for name, p in model.named_parameters()}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                value = value.to_local() if hasattr(value, "to_local") else value
                out[f"opt{index}.{key}"] = value.detach().cpu().reshape(-1).tolist()
    return out


def probe(rank: int, world: int, out: Path) -> dict:
    """The probe under each of ``LIMITS`` (``;``-separated runs, one ``,``-separated budget per
    rank): each run's agreed answer, trials, and whether model and optimizer came back exactly."""
    runs = {}
    if os.environ.get("SETTLE_SKEW"):  # the answer's settling trial as on a GPU, where only rank 0's
        # reserved memory keeps growing: the ranks must still run the same steps (they agree)
        import autobatch.probe.find as find_module
        import autobatch.probe.trial as trial_module

        class Settling(trial_module.TrialRunner):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "settle_final": True})

        find_module.TrialRunner = Settling
        trial_module.growing = lambda reserved: rank == 0
    for limits in os.environ.get("LIMITS", "6MiB,4MiB;4MiB,4MiB").split(";"):
        limit = limits.split(",")[rank % len(limits.split(","))]
        model, optimizer = build()
        before = shards(model, optimizer)
        generator = torch.Generator().manual_seed(rank)
        if os.environ.get("SNAPSHOT_IN_FORWARD"):
            _snapshot_inside_forward(model)

        def make_batch(size: int):
            return torch.randint(0, VOCAB, (size, SEQ), generator=generator).to(device())

        step = TrainStep(model, optimizer, loss_fn, make_batch)
        result = find_max_batch(step, strategy=os.environ.get("STRATEGY", "binary"), memory_limit=limit, steps_per_trial=1,
                                max_batch=int(os.environ.get("PROBE_MAX", "64")), cache=False, estimate_first=False)
        try:  # the fake-tensor estimate cannot trace FSDP's collectives: it must say so
            from autobatch import estimate_memory

            estimate_memory(step, 4)
            estimate = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            estimate = f"{type(exc).__name__}: {exc}"
        runs[limits] = {"batch_size": result.batch_size, "trials": [t.batch_size for t in result.trials], "estimate": estimate,
                        "steps": [t.steps for t in result.trials],
                        "restored": shards(model, optimizer) == before}
    return runs


def _snapshot_inside_forward(model) -> None:
    """Make the probe's background snapshot copy run inside the first trial's forward, while
    FSDP has swapped full (unsharded) parameters into the root: a GPU's timing, made certain.
    The snapshot copies (a fresh AdamW would otherwise step the trials at learning rate 0)."""
    import threading

    import autobatch.probe.snapshot.restore as restore_module

    restore_module.steps_in_place_at_zero_lr = lambda optimizer: False
    pending = []

    class Deferred(threading.Thread):
        def start(self) -> None:
            pending.append(self)

    restore_module.threading = type("threading", (), {"Thread": Deferred})

    def run_pending(*_):
        while pending:
            thread = pending.pop()
            threading.Thread.start(thread)
            thread.join()

    model.blocks[0].register_forward_pre_hook(run_pending)


class Inside:
    """An OOM raised on one rank *inside* FSDP's forward or backward (in a block, between its
    collectives) or inside FSDP's all-gather buffer allocation, at a chosen runner step."""

    def __init__(self, model, runner, where: str, step: int = 1) -> None:
        self.runner, self.where, self.step, self.fired = runner, where, step, 0
        block = model.blocks[-1]
        if where == "block_forward":
            block.register_forward_hook(lambda *_: self.fire())
        elif where == "block_backward":
            block.register_full_backward_hook(lambda *_: self.fire())
        elif where == "all_gather":
            group = _param_groups(model.blocks[0]._get_fsdp_state())[0]  # torch 2.11: one group; 2.13: a list
            comm = group._all_gather_comm
            inner = getattr(comm, "inner", comm)
            allocate = inner.allocate

            def failing_allocate(*args, **kwargs):
                self.fire()
                return allocate(*args, **kwargs)

            inner.allocate = failing_allocate

    def fire(self) -> None:
        if self.runner.step == self.step and not self.fired:
            self.fired += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected inside FSDP: {self.where})")


def train(rank: int, world: int, out: Path) -> dict:
    """One run per entry of ``FAULTS`` (``,``-separated; ``none``, a phase, or ``inside:<where>``),
    injected on rank ``FAULT_RANK`` at step 1: each run's final shards, recoveries and loss."""
    runs = {}
    for fault in os.environ.get("FAULTS", "none,forward,backward,optimizer").split(","):
        model, optimizer = build()
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, VOCAB, (16, SEQ), generator=generator) for _ in range(2)]
        local = [batch[rank * 8 : (rank + 1) * 8] for batch in data]
        runner = Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=4, device=device(), progress=False, log_every=None)
        if fault != "none" and rank == int(os.environ.get("FAULT_RANK", "1")):
            if fault.startswith("inside:"):
                Inside(model, runner, fault.split(":", 1)[1], int(os.environ.get("FAULT_STEP", "1")))
            else:
                runner.faults = FaultInjector((1, fault))
        began = time.perf_counter()
        if os.environ.get("PROFILE"):  # a profile of rank 0's run, for slow-test hunting
            import cProfile

            with cProfile.Profile() as profile:
                result = runner.fit(local, epochs=1)
            profile.dump_stats(str(out / f"profile{rank}.out"))
        else:
            result = runner.fit(local, epochs=1)
        runs[fault] = {"seconds": round(time.perf_counter() - began, 2), "shards": shards(model, optimizer), "recoveries": result.oom_recoveries,
                       "micro_batch": runner.micro_batch, "loss": result.last_loss, "steps": result.steps}
    return runs


def resume(rank: int, world: int, out: Path) -> dict:
    """4 steps uninterrupted, against 2 steps with a checkpoint after each, a stop, and a
    resume in a fresh model and runner for the other 2: each rank's final shards. Then the
    same checkpoint under another world size's file names: the resume's error."""
    from autobatch.errors import CheckpointError

    def run(checkpoint_dir: Path | None, steps: int, resume_from: Path | None = None):
        model, optimizer = build()
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, VOCAB, (16, SEQ), generator=generator)[rank * 8 : (rank + 1) * 8] for _ in range(4)]
        runner = Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=4, device=device(), progress=False,
                        log_every=None, checkpoint_dir=checkpoint_dir, checkpoint_every=1 if checkpoint_dir else None)
        result = runner.fit(data, steps=steps, resume=resume_from)
        return shards(model, optimizer), result

    whole, _ = run(None, 4)
    run(out / "ckpt", 2)
    files = sorted(p.name for p in (out / "ckpt").iterdir())
    resumed, result = run(out / "ckpt", 4, resume_from=out / "ckpt")
    report = {"whole": whole, "resumed": resumed, "files": files, "resumed_from": result.resumed_from,
              "checkpoint_path": result.checkpoint_path}
    other = out / "other"  # the same shards named as if written by 4 ranks
    other.mkdir(exist_ok=True)
    dist.barrier()
    if rank == 0:
        for r in range(world):
            (other / f"last.rank{r}-of-4.pt").write_bytes((out / "ckpt" / f"last.rank{r}-of-{world}.pt").read_bytes())
    dist.barrier()
    try:
        run(None, 4, resume_from=other)
    except CheckpointError as exc:
        report["other_world"] = str(exc)
    return report


def checkpointing(rank: int, world: int, out: Path) -> dict:
    """Activation checkpointing on the sharded blocks: the planner (a budget under which the
    per-rank batch of 8 fits in one step only with checkpointing, ``CKPT_LIMIT``) wraps them,
    and the runner trains the planned (wrapped) model; a fresh unwrapped model trains the same
    batches for comparison. Each run's final shards and the plan."""
    from autobatch import plan
    from autobatch.planning.checkpointing import find_blocks, is_checkpointed

    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (16, SEQ), generator=generator)[rank * 8 : (rank + 1) * 8] for _ in range(3)]
    report = {}
    model, optimizer = build(width=64, layers=3)
    report["blocks"] = find_blocks(model, ["_DecoderBlock"])
    probe_generator = torch.Generator().manual_seed(rank)
    step = TrainStep(model, optimizer, loss_fn, lambda n: torch.randint(0, VOCAB, (n, SEQ), generator=probe_generator).to(device()))
    planned = plan(step, global_batch=8, allow_accumulation=False, memory_limit=os.environ.get("CKPT_LIMIT", "6MiB"),
                   max_batch=8, steps_per_trial=1, strategy="binary", cache=False, estimate_first=False)
    report["plan"] = {"checkpointing": planned.checkpointing, "micro_batch": planned.micro_batch,
                      "modules": planned.checkpointed_modules, "reason": planned.reason}
    report["wrapped"] = [is_checkpointed(block) for block in model.blocks]
    runs = {"planned": (model, optimizer), "plain": build(width=64, layers=3)}  # the plan's model stays wrapped
    for name, (model, optimizer) in runs.items():
        runner = Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=planned.micro_batch, device=device(),
                        progress=False, log_every=None, grow_after=None)
        result = runner.fit(data)
        report[name] = {"shards": shards(model, optimizer), "loss": result.last_loss, "steps": result.steps,
                        "recoveries": result.oom_recoveries}
    return report


def clipped(rank: int, world: int, out: Path) -> dict:
    """Gradient clipping over the shards (``max_grad_norm``: the global norm, an all-reduce of
    the DTensor norms): unclipped, clipped, and clipped with an OOM injected inside the
    optimizer phase on rank 1 at step 1; each run's final shards and loss."""
    runs = {}
    for name, norm, faults in (("unclipped", None, None), ("clipped", 0.05, None),
                               ("clipped_oom", 0.05, FaultInjector((1, "optimizer")) if rank == 1 else None)):
        model, optimizer = build()
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, VOCAB, (16, SEQ), generator=generator) for _ in range(2)]
        local = [batch[rank * 8 : (rank + 1) * 8] for batch in data]
        runner = Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=4, device=device(), progress=False,
                        log_every=None, max_grad_norm=norm, faults=faults)
        result = runner.fit(local, epochs=1)
        runs[name] = {"shards": shards(model, optimizer), "loss": result.last_loss, "recoveries": len(result.oom_recoveries)}
    return runs


def _as_on_gpu() -> None:
    """Make three things of the GPU image certain for the scenarios after this one in the launch
    (so they run last): FSDP's state reset as on torch < 2.13 (no ``reset_iter_state``: a plain
    ``reshard()`` there left the root unsharded), the answer's settling steps growing on rank 0
    only (the ranks must still run the same steps: each is a collective), and the probe's
    background snapshot copying while FSDP has the root's full parameters swapped in. One launch
    with the other scenarios: a second launch cost ~15 s of CI."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "reset_iter_state"):
        del FSDPModule.reset_iter_state
    os.environ.update(SETTLE_SKEW="1", SNAPSHOT_IN_FORWARD="1", LIMITS="6MiB,3MiB")


def probe_as_on_gpu(rank: int, world: int, out: Path) -> dict:
    _as_on_gpu()
    return probe(rank, world, out)


def train_as_on_gpu(rank: int, world: int, out: Path) -> dict:
    _as_on_gpu()
    return train(rank, world, out)


SCENARIOS = {"probe": probe, "train": train, "resume": resume, "checkpointing": checkpointing, "clipped": clipped,
             "probe_as_on_gpu": probe_as_on_gpu, "train_as_on_gpu": train_as_on_gpu}

if __name__ == "__main__":
    main(SCENARIOS)
