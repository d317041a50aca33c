"""One rank of ``test_ranks_agree.py`` (gloo, CPU): what the ranks must agree on besides a step.

Run as ``python tests/distributed/agreement_worker.py SCENARIO OUT_DIR`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports (``rank<r>.json``) and teardown are
``tests/distributed/rank_worker.py``'s. Each scenario catches only the error it expects: any other
is reported as a crash and fails the test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE.parent / "distributed")]

from runner_workloads import FEATURES, make_data, mse  # noqa: E402

import autobatch.training.checkpoints.resume as resume_module  # noqa: E402
from autobatch import Runner, TrainStep, find_max_batch, inject_oom  # noqa: E402
from autobatch.errors import CheckpointError, PeerFailedError  # noqa: E402
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint  # noqa: E402
from autobatch import UnevenDataError  # noqa: E402
from rank_worker import main  # noqa: E402


def _share(batch, rank: int, world: int):
    size = batch[0].shape[0] // world
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def _linear_runner(**options) -> Runner:
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1).double()
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=4,
                  grow_after=None, progress=False, log_every=None, **options)


class _Stream:
    """Re-iterable batches with no ``len``, as a generator-backed stream."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def uneven(rank: int, world: int, out: Path) -> dict:
    """Rank 0's data has 3 batches, rank 1's 4: a list (lengths compared before the epoch), a
    stream without a length (checked at each step), and even streams (which train through)."""
    report = {}
    batches = [_share(batch, rank, world) for batch in make_data(16 * (3 + rank), 16)]
    for name, data in (("list", batches), ("stream", _Stream(batches))):
        trained = []
        try:
            _linear_runner().fit(data, epochs=2, on_step_end=lambda info: trained.append([info["step"], info["epoch"]]))
            report[name] = {"error": None, "trained": trained}
        except UnevenDataError as exc:
            report[name] = {"error": str(exc), "trained": trained}
    result = _linear_runner().fit(_Stream(batches[:3]), epochs=2)
    report["even"] = {"steps": result.steps, "epochs": result.epochs}
    return report


class _Ballast(torch.nn.Module):
    """Exactly the identity, with a 64 KiB per sample temporary in forward only: a budget then
    runs out inside the DDP module's forward, before DDP's post-forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(x.shape[0], 8192, dtype=x.dtype, device=x.device).sum()


def _bn_model(hungry: bool = False) -> torch.nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    if hungry:
        layers.insert(2, _Ballast())
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers).double())


def _state(model) -> list:
    return [t.detach().tolist() for t in (*model.parameters(), *model.buffers())]


def ddp_buffers(rank: int, world: int, out: Path) -> dict:
    """A DDP model with BatchNorm (buffers DDP broadcasts at each step's start) and an OOM on
    rank 1 only, in the first micro-batch's forward of step 1: both ranks replay; against the
    same run given micro-batch 4 for step 0 and 2 from step 1 on (the replay's size). Then the
    probe through DDP under a budget per rank, which fails trials on rank 1 alone."""
    data = [_share(batch, rank, world) for batch in make_data(48, 16)]
    model = _bn_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=4,
                    grow_after=None, progress=False, log_every=None)
    if rank == 1:
        inject_oom(runner, at=[(1, "forward")], times=1)
    result = runner.fit(data)
    reference = _bn_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for micro, part in ((4, data[:1]), (2, data[1:])):
        Runner(reference, optimizer, mse, global_batch=16, micro_batch=micro, grow_after=None, progress=False,
               log_every=None).fit(part)
    probed = _bn_model(hungry=True)
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int):
        return (torch.randn(size, FEATURES, generator=generator, dtype=torch.float64),
                torch.zeros(size, 1, dtype=torch.float64))

    answer = find_max_batch(TrainStep(probed, torch.optim.SGD(probed.parameters(), lr=0.01), mse, make_batch),
                            strategy="binary", start=2, multiple_of=2, memory_limit=["3MiB", "1536KiB"][rank], steps_per_trial=1,
                            max_batch=256,
                            cache=False)
    return {"recoveries": len(result.oom_recoveries), "steps": result.steps, "samples": result.samples,
            "state": _state(model), "reference": _state(reference), "probe": answer.batch_size,
            "probe_trials": [t.batch_size for t in answer.trials]}


def checkpoints(rank: int, world: int, out: Path) -> dict:
    """Rank 0 writes ``last.pt`` slowly: every rank's fit() returns only once it is there, and
    resumes from it at once. A checkpoint rank 1 cannot read, and a write that fails on rank 0,
    are one error on every rank."""
    report = {}
    write = resume_module.save_checkpoint
    data = [_share(batch, rank, world) for batch in make_data(64, 16)]

    def slow(state, path):
        time.sleep(1.5)
        return write(state, path)

    resume_module.save_checkpoint = slow if rank == 0 else write
    try:
        _linear_runner(checkpoint_dir=out / "ckpt").fit(data, steps=2)
        report["seen_step"] = load_checkpoint(out / "ckpt")["step"]  # raises if the file is not there yet
    finally:
        resume_module.save_checkpoint = write
    report["resumed_steps"] = _linear_runner().fit(data, steps=4, resume=out / "ckpt").steps
    try:
        _linear_runner().fit(data, steps=4, resume=out / ("ckpt" if rank == 0 else "nowhere"))
    except CheckpointError as exc:
        report["unreadable"] = str(exc)

    def broken(state, path):
        raise OSError(28, "No space left on device")

    resume_module.save_checkpoint = broken if rank == 0 else write
    try:
        _linear_runner(checkpoint_dir=out / "full").fit(data, steps=1)
    except (OSError, PeerFailedError) as exc:
        report["failed_write"] = type(exc).__name__
    finally:
        resume_module.save_checkpoint = write
    return report


SCENARIOS = {"uneven": uneven, "ddp_buffers": ddp_buffers, "checkpoints": checkpoints}


if __name__ == "__main__":
    main(SCENARIOS)
