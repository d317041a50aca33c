"""One rank of ``test_review14_fsdp_configs.py`` (gloo, CPU): FSDP2 configured as real FSDP2 code does.

Run as ``python tests/distributed/review14_fsdp_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and teardown:
``rank_worker.py``. A small MLP (``nn.Sequential`` of 3 linears), its first two linears and the
root ``fully_shard`` -ed with the options of each configuration (:func:`build`), AdamW.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner, TrainStep, find_max_batch, inject_oom  # noqa: E402
from rank_worker import main  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)
#: configuration -> the phase rank 1 runs out of memory in at step 1
CONFIGS = {"bf16": "forward", "zero2": "backward", "reshard_int": "optimizer", "root_only": "backward", "lora": "optimizer"}


class Lora(nn.Module):
    """A frozen linear plus a trainable low-rank update (LoRA): frozen and trainable parameters
    in one FSDP unit."""

    def __init__(self, fan_in: int, fan_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, fan_in) * 0.1)
        self.b = nn.Parameter(torch.full((fan_out, rank), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def dtype_of(kind: str) -> torch.dtype:
    return torch.float32 if kind == "bf16" else torch.float64


def build(kind: str, width: int = 8) -> nn.Module:
    """The same model on every rank, sharded as ``kind`` says: ``bf16`` (MixedPrecisionPolicy
    bf16 compute, fp32 reduce), ``zero2`` (reshard_after_forward=False), ``reshard_int``
    (reshard_after_forward=1), ``root_only`` (one ``fully_shard(model)``, torch's default mesh),
    ``lora`` (frozen bases and a frozen plain head), ``hsdp`` (a (2, 1) replicate x shard mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    if kind == "lora":
        model = nn.Sequential(Lora(6, width), nn.Tanh(), Lora(width, width), nn.Tanh(), nn.Linear(width, 1))
        model[4].requires_grad_(False)
    else:
        model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    model = model.to(dtype_of(kind))
    if kind == "root_only":
        return fully_shard(model)
    options: dict = {
        "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "zero2": {"reshard_after_forward": False}, "reshard_int": {"reshard_after_forward": 1},
    }.get(kind, {})
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if kind == "hsdp" \
        else init_device_mesh("cpu", (world,))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def data(rank: int, kind: str, steps: int = 3, share: int = 8) -> list:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2 * share * steps, 6, generator=generator, dtype=dtype_of(kind))
    y = torch.randn(2 * share * steps, 1, generator=generator, dtype=dtype_of(kind))
    return [(x[i + rank * share : i + (rank + 1) * share], y[i + rank * share : i + (rank + 1) * share])
            for i in range(0, 2 * share * steps, 2 * share)]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1].float())


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """This rank's local shards of the weights and of AdamW's moments, as lists."""
    out = [p.to_local().detach().double().reshape(-1).tolist() for p in model.parameters()]
    for entries in optimizer.state.values():
        out += [v.to_local().detach().double().reshape(-1).tolist() for v in entries.values() if hasattr(v, "to_local")]
    return out


def _runner(kind: str, micro: int, model=None, optimizer=None, scheduler=None, **options) -> Runner:
    """A runner on a fresh ``build(kind)`` (or on ``model``); ``lora`` clips and has a scheduler."""
    model = model if model is not None else build(kind)
    optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if kind == "lora":
        options["max_grad_norm"] = 0.05
        scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1 + k))
    return Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=micro, scheduler=scheduler, **options, **QUIET)


def configs(rank: int, world: int, out: Path) -> dict:
    """For each of :data:`CONFIGS`: an OOM on rank 1 at step 1 (micro-batch 8 -> 4; 8 again in the
    optimizer step, which the micro-batch does not size) against a run given micro-batch 8 for step 0
    and that size from step 1 on; 2 steps with checkpoints and a resume
    in a fresh model for the third against 3 steps uninterrupted. Equal means bit-equal."""
    report = {}
    for kind, phase in CONFIGS.items():
        batches = data(rank, kind)
        first = _runner(kind, 8)
        first.fit(batches[:1])
        rest = _runner(kind, 8 if phase == "optimizer" else 4, first.model, first.optimizer, first.scheduler)
        rest.step = 1  # the scheduler's and the fault's step count
        rest.fit(batches[1:])
        reference = state(first.model, first.optimizer)
        injected = _runner(kind, 8)
        if rank == 1:
            inject_oom(injected, at=[(1, phase)])
        result = injected.fit(batches)
        whole = _runner(kind, 4)
        whole.fit(batches)
        _runner(kind, 4, checkpoint_dir=out / kind, checkpoint_every=1).fit(batches, steps=2)
        resumed = _runner(kind, 4, checkpoint_dir=out / kind)
        resumed.fit(batches, steps=3, resume=out / kind)
        report[kind] = {
            "recoveries": [[r["micro_batch_before"], r["micro_batch"]] for r in result.oom_recoveries],
            "replay_equal": state(injected.model, injected.optimizer) == reference,
            "resume_equal": state(resumed.model, resumed.optimizer) == state(whole.model, whole.optimizer),
            "trained": state(whole.model, whole.optimizer) != state(build(kind), whole.optimizer),
            "lr": resumed.optimizer.param_groups[0]["lr"],
        }
    return report


def probe_plan(rank: int, world: int, out: Path) -> dict:
    """The probe on ``bf16`` and ``zero2`` models under a different cap per rank (one answer,
    shards restored), and ``Runner(micro_batch=None)`` planning a ``bf16`` model with clipping
    and a scheduler, then replaying an OOM on rank 1."""
    report = {}
    for kind in ("bf16", "zero2"):
        model = build(kind, width=64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(rank)
        dtype = dtype_of(kind)
        step = TrainStep(model, optimizer, loss_fn, lambda n: (torch.randn(n, 6, generator=generator, dtype=dtype),
                                                               torch.randn(n, 1, generator=generator, dtype=dtype)))
        before = state(model, optimizer)
        found = find_max_batch(step, strategy="binary", memory_limit=["2MiB", "1MiB"][rank], max_batch=2048,
                               steps_per_trial=1, cache=False, estimate_first=False)
        report[kind] = {"batch_size": found.batch_size, "restored": state(model, optimizer) == before}
    model = build("bf16", width=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1 + k))
    runner = Runner(model, optimizer, loss_fn, global_batch=1024, micro_batch=None, scheduler=scheduler, max_grad_norm=0.1,
                    plan_options={"memory_limit": ["384KiB", "256KiB"][rank], "cache": False}, **QUIET)
    if rank == 1:
        inject_oom(runner, at=[(1, "backward")])
    result = runner.fit(data(rank, "bf16", steps=2, share=512))
    report["plan"] = {"planned": result.plan["micro_batch"], "micro_batch": result.micro_batch, "steps": result.steps,
                      "recoveries": [[r["micro_batch_before"], r["micro_batch"]] for r in result.oom_recoveries],
                      "lr": optimizer.param_groups[0]["lr"]}
    return report


def peer_error(rank: int, world: int, out: Path) -> dict:
    """A ``ValueError`` on rank 1 at step 1 in a hook of the middle block (forward on a ``bf16``
    model, backward on a ``zero2`` one), between FSDP's collectives. Rank 1 then waits in a
    barrier (no vote pairs with it): rank 0 must raise at its next vote, not at a deadline."""
    report = {}
    for kind, hook in (("bf16", "register_forward_hook"), ("zero2", "register_full_backward_hook")):
        runner = _runner(kind, 4)

        def fail(*_):
            if rank == 1 and runner.step == 1:
                raise ValueError(f"rank 1's {hook}")

        getattr(runner.model[2], hook)(fail)
        began = time.monotonic()
        try:
            runner.fit(data(rank, kind))
            error, message = None, ""
        except Exception as exc:  # noqa: BLE001 - reported
            error, message = type(exc).__name__, str(exc)
        report[kind] = {"error": error, "message": message[:1000], "seconds": time.monotonic() - began}
        dist.barrier()
    return report


def hsdp(rank: int, world: int, out: Path) -> dict:
    """A (2, 1) replicate x shard mesh (HSDP): its gradient all-reduce is not voted on, so a
    one-rank OOM (injected on rank 1 at step 1) left the other rank in it until the deadline. Now
    refused at the runner's start, before any step."""
    try:
        runner = _runner("hsdp", 8)
        if rank == 1:
            inject_oom(runner, at=[(1, "backward")])
        runner.fit(data(rank, "hsdp"))
        error, message = None, ""
    except Exception as exc:  # noqa: BLE001 - reported
        error, message = type(exc).__name__, str(exc)
    # the launch's last scenario: rank 0 hosts the store, and its process exits right after this
    # returns; a rank 1 still finishing the 2-D mesh's groups then lost its connection to it
    dist.barrier()
    return {"error": error, "message": message[:1000]}


SCENARIOS = {"configs": configs, "probe_plan": probe_plan, "peer_error": peer_error, "hsdp": hsdp}

if __name__ == "__main__":
    main(SCENARIOS)
