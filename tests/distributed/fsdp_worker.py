"""One rank of the FSDP2 tests in ``test_fsdp.py`` (gloo, CPU; NCCL under torchrun with ``BACKEND=nccl``).

Run as ``python tests/distributed/fsdp_worker.py SCENARIO OUT_DIR`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. A tiny float64 GPT (autobatch's built-in), each block
and the root ``fully_shard`` -ed on a 1-D mesh, AdamW. Writes ``OUT_DIR/rank<r>.json`` and
exits with ``os._exit`` so a broken process group cannot stall the teardown.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autobatch import Runner, TrainStep, find_max_batch  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from autobatch.dist.fsdp_guard import _param_groups  # noqa: E402
from autobatch.training.faults import FaultInjector  # noqa: E402
from autobatch.workloads.models import GPT  # noqa: E402

VOCAB, SEQ = 32, 16


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


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
        trial_module._growing = lambda reserved: rank == 0
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
        runs[limits] = {"batch_size": result.batch_size, "trials": [t.batch_size for t in result.trials],
                        "steps": [t.steps for t in result.trials],
                        "restored": shards(model, optimizer) == before}
    return runs


def _snapshot_inside_forward(model) -> None:
    """Make the probe's background snapshot copy run inside the first trial's forward, while
    FSDP has swapped full (unsharded) parameters into the root: a GPU's timing, made certain."""
    import threading

    import autobatch.probe.restore as restore_module

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


SCENARIOS = {"probe": probe, "train": train}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    backend = os.environ.get("BACKEND", "gloo")
    if backend == "nccl":
        local_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local_device)
        dist.init_process_group(backend, device_id=local_device)
    else:
        dist.init_process_group(backend)
    if os.environ.get("TORCH_211_RESET"):  # recover as on torch < 2.13 (no FSDPModule.reset_iter_state)
        from torch.distributed.fsdp import FSDPModule

        if hasattr(FSDPModule, "reset_iter_state"):
            del FSDPModule.reset_iter_state
    dist_sync.control_group()
    dist_sync.set_timeout(float(os.environ.get("SYNC_TIMEOUT", "60")))
    rank, world = dist.get_rank(), dist.get_world_size()
    code = 0
    try:
        report = SCENARIOS[scenario](rank, world, out)
    except BaseException:  # noqa: BLE001 - reported to the parent test
        report, code = {"crash": traceback.format_exc()}, 1
    (out / f"rank{rank}.json").write_text(json.dumps(report, default=str), encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
