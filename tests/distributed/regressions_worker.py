"""One rank of ``test_regressions.py``: the distributed bugs an adversarial review found (gloo, CPU).

Run as ``python tests/distributed/regressions_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and
teardown: ``rank_worker.py``. Every model is float64, so runs that split the same global
batches differently agree up to summation order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner, TrainStep, find_max_batch, inject_oom  # noqa: E402
from autobatch.errors import RankDisagreementError  # noqa: E402
from rank_worker import main  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)


def _data(samples: int = 48, global_batch: int = 16, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(samples, 1, generator=generator, dtype=torch.float64)
    return [(x[i : i + global_batch], y[i : i + global_batch]) for i in range(0, samples, global_batch)]


def _mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


class Seen(nn.Module):
    """Counts the samples its forward saw in a buffer (a stand-in for BatchNorm's statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.seen += x.shape[0]
        return x


class Net(nn.Module):
    """An input layer, two blocks (the FSDP units) and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.seen = Seen()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.out = nn.Linear(8, 1)
        self.double()

    def forward(self, x):
        x = self.inp(self.seen(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _sharded(root: bool = True) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> list[list[float]]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).reshape(-1).tolist() for p in model.parameters()]


def _reference(data, micro_batch: int = 4) -> list[list[float]]:
    """One process training the same global batches (no sharding, no ranks)."""
    model = Net()
    Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), _mse, global_batch=16, micro_batch=micro_batch,
           distributed=False, **QUIET).fit(data)
    return _full(model)


def fsdp_uneven(rank: int, world: int, out: Path) -> dict:
    """Global batch 16 cut 6 / 10 over the ranks, micro-batch 4: rank 0 has 2 micro-batches,
    rank 1 has 3 (each one a run of FSDP collectives). Weights vs one process; the samples
    rank 0's forward counted (its buffers are the ones broadcast after each step)."""
    data = _data()
    model = _sharded()
    mine = [tuple(t[:6] if rank == 0 else t[6:] for t in batch) for batch in data]
    result = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), _mse, global_batch=16, micro_batch=4,
                    **QUIET).fit(mine)
    return {"weights": _full(model), "reference": _reference(data), "samples": result.samples,
            "seen": float(model.seen.seen)}


def fsdp_first_step_oom(rank: int, world: int, out: Path) -> dict:
    """An OOM on rank 1 before the model's first forward ever ran (FSDP not lazily initialised
    yet): in the runner's first step, and in the probe's first trial."""
    data = [tuple(t[rank * 8 : (rank + 1) * 8] for t in batch) for batch in _data()]
    report = {}
    for where in ("transfer", "forward"):
        model = _sharded()
        runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), _mse, global_batch=16, micro_batch=4,
                        **QUIET)
        if rank == 1:
            inject_oom(runner, at=(0, where))
        result = runner.fit(data)
        report[where] = {"recoveries": [(r["step"], r["phase"]) for r in result.oom_recoveries], "weights": _full(model)}
    report["reference"] = _reference(_data())
    model = _sharded()

    def make_batch(size: int):
        if rank == 1 and size > 32:
            raise torch.OutOfMemoryError("CUDA out of memory (injected before the first forward)")
        return torch.randn(size, 6, dtype=torch.float64), torch.randn(size, 1, dtype=torch.float64)

    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=0.01), _mse, make_batch)
    report["probe"] = find_max_batch(step, strategy="binary", start=64, max_batch=128, cache=False,
                                     steps_per_trial=1, estimate_first=False).batch_size
    return report


def fsdp_partial(rank: int, world: int, out: Path) -> dict:
    """Only the blocks ``fully_shard`` -ed, the root not (its input and output layers stay
    plain): without faults, and with an OOM on rank 1 inside block 1's forward at step 1;
    then with ``max_grad_norm`` (refused: torch cannot clip sharded and plain gradients together)."""
    data = _data(64)
    mine = [tuple(t[rank * 8 : (rank + 1) * 8] for t in batch) for batch in data]
    report = {"reference": _reference(data)}
    for fault in ("none", "block1_forward"):
        model = _sharded(root=False)
        runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), _mse, global_batch=16, micro_batch=4,
                        **QUIET)
        fired = []

        def fire(*_):
            if rank == 1 and runner.step == 1 and not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory (injected inside block 1)")

        if fault != "none":
            model.blocks[1].register_forward_hook(fire)
        result = runner.fit(mine)
        report[fault] = {"weights": _full(model), "recoveries": len(result.oom_recoveries)}
    model = _sharded(root=False)
    try:
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _mse, global_batch=16, micro_batch=4, max_grad_norm=1.0,
               **QUIET).fit(mine[:1])
        report["clipped"] = None
    except ValueError as exc:
        report["clipped"] = str(exc)
    return report


class Branches(nn.Module):
    """``unused`` never runs; ``extra`` runs on rank 0 only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.unused, self.extra = nn.Linear(6, 1), nn.Linear(6, 1), nn.Linear(6, 1)
        self.use_extra = rank == 0
        self.double()

    def forward(self, x):
        return self.a(x) + (self.extra(x) if self.use_extra else 0.0)


def ddp_unused(rank: int, world: int, out: Path) -> dict:
    """DDP(find_unused_parameters=True) through the runner against a hand-written DDP loop."""
    data = [tuple(t[rank * 8 : (rank + 1) * 8] for t in batch) for batch in _data()]
    runs = {}
    for name in ("hand", "runner"):
        model = Branches(rank)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        if name == "hand":
            for batch in data:
                optimizer.zero_grad(set_to_none=True)
                _mse(ddp, batch).backward()
                optimizer.step()
        else:
            Runner(ddp, optimizer, _mse, global_batch=16, micro_batch=8, **QUIET).fit(data)
        runs[name] = {"weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
                      "unused_state": len(optimizer.state.get(model.unused.weight, {}))}
    return runs


def _ddp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def ddp_hook(rank: int, world: int, out: Path) -> dict:
    """After fit on data whose last global batch is short (12 = 6 per rank), a plain DDP
    backward on the same model against a fresh DDP; then a model with a built-in comm hook."""
    from autobatch.dist.ddp_step import ledger_for

    model = _ddp_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    data = [tuple(t[rank * (t.shape[0] // 2) : (rank + 1) * (t.shape[0] // 2)] for t in batch) for batch in _data(44)]
    Runner(ddp, torch.optim.SGD(model.parameters(), lr=0.1), _mse, global_batch=16, micro_batch=8, **QUIET).fit(data)
    plain = _ddp_model()
    plain.load_state_dict(model.state_dict())
    plain_ddp = nn.parallel.DistributedDataParallel(plain)
    for _ in range(2):  # twice: nothing about the hook's state carries from one backward to the next
        for each in (ddp, plain_ddp):
            each.zero_grad()
            _mse(each, data[0]).backward()
    report = {"ratio": (model[0].weight.grad / plain[0].weight.grad).mean().item(),
              "launched_after": len(ledger_for(ddp).launched)}
    builtin = nn.parallel.DistributedDataParallel(_ddp_model())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    try:
        result = Runner(builtin, torch.optim.SGD(builtin.parameters(), lr=0.1), _mse, global_batch=16, micro_batch=8,
                        **QUIET).fit(data)
        report["builtin"] = {"samples": result.samples}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["builtin"] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


def _refusals(model: nn.Module) -> dict:
    """The ``ValueError`` s of ``Runner(model, ...)`` and ``find_max_batch`` on it (None: none)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report = {}
    try:
        Runner(model, optimizer, _mse, global_batch=16, micro_batch=8, **QUIET)
        report["runner"] = None
    except ValueError as exc:
        report["runner"] = str(exc)
    step = TrainStep(model, optimizer, _mse, lambda n: _data(n, n)[0])
    try:
        find_max_batch(step, strategy="binary", max_batch=8, cache=False, steps_per_trial=1, estimate_first=False)
        report["probe"] = None
    except ValueError as exc:
        report["probe"] = str(exc)
    return report


def subgroups(rank: int, world: int, out: Path) -> dict:
    """DDP over a group of one rank in a job of two, and FSDP over a mesh of one rank: the
    runner and the probe refuse both."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    groups = [dist.new_group([r]) for r in range(world)]
    ddp = nn.parallel.DistributedDataParallel(_ddp_model(), process_group=groups[rank])
    sharded = _ddp_model()
    fully_shard(sharded, mesh=DeviceMesh.from_group(groups[rank], "cpu"))
    return {"ddp": _refusals(ddp), "fsdp": _refusals(sharded)}


def store_keys(rank: int, world: int, out: Path) -> dict:
    """What the FSDP votes leave in the store after 2 and after 8 steps: rows still queued (every
    row pushed must have been popped) and keys of the per-vote kind."""
    from autobatch.dist import agreement

    store = agreement._store()
    left = {}
    for steps in (2, 8):
        model = _sharded()
        data = [tuple(t[rank * 8 : (rank + 1) * 8] for t in batch) for batch in _data(16 * steps)]
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.01), _mse, global_batch=16, micro_batch=8, **QUIET).fit(data)
        dist.barrier()
        queued = sum(store.queue_len(f"autobatch/votes/{to}/{r}") for to in range(world) for r in range(world))
        keys = [f"autobatch/vote/{n}/{r}" for n in range(agreement._state["sequence"] + 1) for r in range(world)]
        left[str(steps)] = {"queued": queued, "keys": sum(store.check([key]) for key in keys),
                            "votes": agreement._state["sequence"]}
        dist.barrier()  # every rank counted before the next run
    return left


def mispaired(rank: int, world: int, out: Path) -> dict:
    """Healthy ranks at different FSDP collectives of one step: every rank raises at once."""
    from autobatch.dist.fsdp_guard import ALL_GATHER, REDUCE_SCATTER, voting

    with voting("mispaired step") as ballot:
        ballot.vote()  # the same first vote
        try:
            ballot.vote(kind=ALL_GATHER if rank == 0 else REDUCE_SCATTER)
        except RankDisagreementError as exc:
            return {"error": str(exc), "settled": ballot.settled}
    return {"error": None}


def _trainer_under(budget: str, batch: int, tmp: Path):
    """A ``transformers.Trainer`` (a 1.6 M-parameter GPT-2, CPU) built under ``budget``, so the
    simulated device counts its weights (Accelerate's ``model.to`` copies them over several
    processes on the CPU: uncounted originals would make the copies look like new memory)."""
    import transformers

    class Collator:
        def __call__(self, samples):
            ids = torch.zeros(len(samples), 32, dtype=torch.long)
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=256, n_layer=2, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(tmp), per_device_train_batch_size=batch, max_steps=2,
                                          use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, dataloader_drop_last=True)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, data_collator=Collator(),
                                train_dataset=[{"input_ids": [1] * 32}] * 256)


def hf_ddp(rank: int, world: int, out: Path) -> dict:
    """``fit_batch_size`` over two processes, whose ``train()`` wraps the model in DDP (its
    gradient buckets as large as the parameters), then ``train()`` at the answer and one above,
    each under the same 32 MiB (measured: the unwrapped probe answered 5, which ran out of
    memory in DDP's first step; 2 trains, 3 does not)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from autobatch import simulated_memory
    from autobatch.integrations.transformers import fit_batch_size
    from autobatch.integrations.transformers_step import ddp_bucket_bytes

    trained = {}
    with simulated_memory("32MiB"):
        trainer = _trainer_under("32MiB", 1, out / "probe")
        bucket_bytes = ddp_bucket_bytes(trainer)
        answer = fit_batch_size(trainer, strategy="binary", cache=False).batch_size
    for size in (answer, answer + 1):
        with simulated_memory("32MiB"):
            trainer = _trainer_under("32MiB", size, out / f"train{size}")
            try:
                trainer.train()
                trained[size] = True
            except torch.OutOfMemoryError:
                trained[size] = False
        dist.barrier()
    parameters = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    return {"answer": answer, "trained": trained[answer], "above_trained": trained[answer + 1],
            "bucket_bytes": bucket_bytes, "parameter_bytes": parameters}


SCENARIOS = {"hf_ddp": hf_ddp, "fsdp_uneven": fsdp_uneven, "fsdp_first_step_oom": fsdp_first_step_oom, "fsdp_partial": fsdp_partial,
             "ddp_unused": ddp_unused, "ddp_hook": ddp_hook, "subgroups": subgroups, "store_keys": store_keys,
             "mispaired": mispaired}

if __name__ == "__main__":
    main(SCENARIOS)
