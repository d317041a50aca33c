"""One rank of the ``test_review11_dist_*.py`` tests (gloo, CPU): scenarios of the eleventh review.

Run as ``python tests/distributed/review11_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and
teardown: ``rank_worker.py``. Every scenario reports what each rank raised and how long it
took (``seconds``) against the sync deadline (``limit``): an error no vote saw used to leave
the other ranks waiting out the whole deadline.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autobatch import Runner, TrainStep, find_max_batch, inject_oom  # noqa: E402
from autobatch import distributed as dist_sync  # noqa: E402
from autobatch.dist.store_exchange import exchange_via_store  # noqa: E402
from rank_worker import main  # noqa: E402
from review10_worker import _data, _sharded  # noqa: E402  (the same FSDP2 model and data)
from agreement_worker import _share  # noqa: E402
from runner_workloads import FEATURES, make_data, mse  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)


_CALLS = [0]  # how many outcomes this rank has taken: every rank takes them in the same order


def _linger(began: float, limit: float) -> None:
    """Stay until every rank has finished the same call (a marker file each, beside the reports),
    at most 1.3 sync deadlines after it began: a rank that raised is alive until its peers
    stopped, so a peer that stopped in time learnt of the error at once, not from the process's
    exit (a peer that did not learn waits out its deadline, which its ``seconds`` show)."""
    _CALLS[0] += 1
    markers = Path(sys.argv[2]) / "linger"
    markers.mkdir(parents=True, exist_ok=True)
    (markers / f"{_CALLS[0]}.rank{dist_sync.rank()}").touch()
    world = dist_sync.world_size()
    while len(list(markers.glob(f"{_CALLS[0]}.rank*"))) < world and time.monotonic() < began + 1.3 * limit:
        time.sleep(0.02)


def _outcome(call, *, linger: bool = True) -> dict:
    """What ``call()`` returned or raised, and when. With ``linger`` every rank then stays until
    every rank has finished (:func:`_linger`), as a script that handles the error would: a rank's
    peers must learn of its error at once, not when its process exits (and the next scenario
    starts on every rank together)."""
    began = time.monotonic()
    try:
        value = call()
        error, message = None, ""
    except BaseException as exc:  # noqa: BLE001 - reported
        value, error, message = None, type(exc).__name__, str(exc)
    seconds, limit = time.monotonic() - began, dist_sync.timeout()
    if linger:
        _linger(began, limit)
    return {"error": error, "message": message[:2000], "seconds": seconds, "limit": limit, "value": value}


def probe_plain_error(rank: int, world: int, out: Path) -> dict:
    """``find_max_batch`` on a plain callable whose step raises a ``ValueError`` on rank 1 alone
    from batch 8 on: no vote sees it (the callable runs no collective)."""
    weight = torch.randn(32, 32, requires_grad=True)

    def step(batch_size: int) -> None:
        if rank == 1 and batch_size >= 8:
            raise ValueError(f"rank 1's data has no batch of {batch_size}")
        (torch.randn(batch_size, 32) @ weight).sum().backward()

    return _outcome(lambda: find_max_batch(step, strategy="binary", max_batch=64, memory_limit="4MiB",
                                           steps_per_trial=1, cache=False).batch_size)


def probe_module_error(rank: int, world: int, out: Path) -> dict:
    """The same with a ``TrainStep`` on a plain module (trained without collectives)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 4)

    def make_batch(batch_size: int):
        if rank == 1 and batch_size >= 8:
            raise KeyError(f"rank 1 has no batch of {batch_size}")
        return torch.randn(batch_size, 32), torch.randn(batch_size, 4)

    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), make_batch)
    return _outcome(lambda: find_max_batch(step, strategy="binary", max_batch=64, memory_limit="4MiB",
                                           steps_per_trial=1, cache=False).batch_size)


def fsdp_resume_bad_shard(rank: int, world: int, out: Path) -> dict:
    """An FSDP2 run saves its sharded checkpoint; rank 1's file is then replaced by one that reads
    fine (the ranks agree they could read their files, and on its step) but whose shard has
    another shape: rank 1's load raises its own ``CheckpointError``."""
    ckpt = out / "ckpt"

    def runner(model: nn.Module) -> Runner:
        return Runner(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=16, micro_batch=8,
                      checkpoint_dir=ckpt, **QUIET)

    runner(_sharded()).fit(_data(rank, 1), steps=1)
    dist_sync.agree(True, "review11: checkpoint written")
    if rank == 1:
        path = next(ckpt.glob("last.rank1-of-*.pt"))
        state = torch.load(path, weights_only=True)
        name = next(iter(state["model"]))
        state["model"][name] = torch.zeros(3, 3, dtype=torch.float64)  # not this rank's shard
        torch.save(state, path)
    dist_sync.agree(True, "review11: file replaced")
    return _outcome(lambda: runner(_sharded()).fit(_data(rank, 2), steps=2, resume=ckpt).steps)


def store_late_peer(rank: int, world: int, out: Path) -> dict:
    """A store vote rank 1 gave up on (its deadline passed) must not read as agreement to rank 0,
    which comes later (rank 0 hosts the store, which outlives rank 1's process): rank 0 would go
    on alone into the collective the vote guards (an FSDP all-gather), and wait there."""
    began, limit = time.monotonic(), dist_sync.timeout()
    dist_sync.set_timeout(2)
    if rank == 0:
        time.sleep(3)  # rank 1 has given up by now
    report = _outcome(lambda: exchange_via_store([rank], "review11: a vote rank 0 comes late to"), linger=False)
    dist_sync.set_timeout(limit)
    time.sleep(max(0.0, began + 3.5 - time.monotonic()))  # the next scenario starts on both ranks together
    # the next store vote pairs as usual: no row of the vote given up on is left queued
    report["next"] = _outcome(lambda: exchange_via_store([10 + rank], "review11: the vote after"), linger=False)
    return report


def _ddp_linear() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    return torch.nn.parallel.DistributedDataParallel(model)


def ddp_multiple(rank: int, world: int, out: Path) -> dict:
    """``Runner(multiple_of=4)`` under DDP, an OOM on rank 1 only at step 1: both ranks replay at
    the same multiple (12 halved is 6, rounded down to 4), against a run given micro-batch 12 for
    step 0 and 4 from step 1 on."""
    data = [_share(batch, rank, world) for batch in make_data(96, 48)]
    options = dict(grow_after=None, progress=False, log_every=None)
    model = _ddp_linear()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=48, micro_batch=12,
                    multiple_of=4, **options)
    if rank == 1:
        inject_oom(runner, at=[(1, "forward")], times=1)
    result = runner.fit(data)
    reference = _ddp_linear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for micro, part in ((12, data[:1]), (4, data[1:])):
        Runner(reference, optimizer, mse, global_batch=48, micro_batch=micro, **options).fit(part)
    return {"recoveries": [(r["micro_batch_before"], r["micro_batch"]) for r in result.oom_recoveries],
            "micro_batch": result.micro_batch, "samples": result.samples,
            "state": [t.detach().tolist() for t in model.parameters()],
            "reference": [t.detach().tolist() for t in reference.parameters()]}


class _Drawing:
    """This rank's shares of ``batches``; on rank 1, drawing batch ``fail_at`` raises (a corrupt
    sample). ``sized``: it has a length (the ranks then agree once per epoch, not per step)."""

    def __init__(self, batches: list, rank: int, fail_at: int, sized: bool) -> None:
        self.batches, self.rank, self.fail_at, self.sized = batches, rank, fail_at, sized

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("a stream has no length")
        return len(self.batches)

    def __iter__(self):
        for index, batch in enumerate(self.batches):
            if self.rank == 1 and index == self.fail_at:
                raise ValueError(f"rank 1's loader: a corrupt sample in batch {index}")
            yield batch


def _draw_error(rank: int, world: int, *, ddp: bool, sized: bool, fail_at: int, micro_batch: int | None) -> dict:
    """``Runner.fit`` where rank 1's data raises drawing a batch and rank 1 then lingers (a script
    that logs the error): rank 0 must stop at once, not wait in the step's collectives (DDP's
    buckets: the default group's timeout) for as long as rank 1's process lives."""
    # 90 samples: the second global batch is short (21 per rank), which each rank's warning names it for
    data = _Drawing([_share(batch, rank, world) for batch in make_data(90, 48)], rank, fail_at, sized)
    model = _ddp_linear() if ddp else _ddp_linear().module
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=48, micro_batch=micro_batch,
                    **QUIET)
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("autobatch").addHandler(handler)
    try:
        return {**_outcome(lambda: runner.fit(data).steps), "warnings": warned}
    finally:
        logging.getLogger("autobatch").removeHandler(handler)


def ddp_draw_error(rank: int, world: int, out: Path) -> dict:
    return _draw_error(rank, world, ddp=True, sized=True, fail_at=1, micro_batch=12)


def stream_draw_error(rank: int, world: int, out: Path) -> dict:
    return _draw_error(rank, world, ddp=False, sized=False, fail_at=1, micro_batch=12)


def plan_draw_error(rank: int, world: int, out: Path) -> dict:
    return _draw_error(rank, world, ddp=True, sized=True, fail_at=0, micro_batch=None)


def _hook_error(rank: int, world: int, out: Path, *, ddp: bool, sized: bool, batches: int, epochs: int,
                fail_after: int, raises: dict, checkpoint_every: int | None = None, checkpoints: bool = True,
                linger: bool = True) -> dict:
    """``Runner.fit(data, on_step_end=hook)`` where the hook raises ``raises[rank]()`` on the ranks
    that have one, after ``fail_after`` steps (a tracker call failing on rank 0, an evaluation),
    and that rank then lingers: every rank must stop at once (the failing ones with their own
    error, its traceback and a note; the others a ``PeerFailedError``), not wait in the next
    step's collectives (DDP's buckets: the default group's timeout) or at the final checkpoint's
    sync point (the sync deadline) for as long as the failing rank's process lives."""
    data = _Drawing([_share(batch, rank, world) for batch in make_data(48 * batches, 48)], rank, -1, sized)
    model = _ddp_linear() if ddp else _ddp_linear().module
    ckpt = out / "ckpt"
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=48, micro_batch=12,
                    checkpoint_dir=ckpt if checkpoints else None, checkpoint_every=checkpoint_every, **QUIET)

    def hook(info: dict) -> None:
        if info["step"] == fail_after and rank in raises:
            raise raises[rank]()

    caught: dict = {}

    def fit():
        try:
            return runner.fit(data, epochs=epochs, on_step_end=hook).steps
        except BaseException as exc:
            caught.update(notes=list(getattr(exc, "__notes__", [])),
                          frames=[frame.name for frame in traceback.extract_tb(exc.__traceback__)])
            raise

    report = _outcome(fit, linger=linger)
    saved = torch.load(ckpt / "last.pt", weights_only=True)["step"] if (ckpt / "last.pt").exists() else None
    return {**report, **caught, "step": runner.step, "saved": saved, "micro_batch": runner.micro_batch,
            "recoveries": len(runner.result.oom_recoveries)}


def _tracker_error() -> Exception:
    return ValueError("rank 1's tracker: connection refused")


def ddp_hook_error(rank: int, world: int, out: Path) -> dict:
    """DDP, 2 batches an epoch: rank 1's hook raises after step 2, the epoch's last (carried over
    the epoch's end to step 3, which is undone); checkpoint_every=1 saved step 2 before the hook."""
    return _hook_error(rank, world, out, ddp=True, sized=True, batches=2, epochs=2, fail_after=2,
                       raises={1: _tracker_error}, checkpoint_every=1)


def stream_hook_last(rank: int, world: int, out: Path) -> dict:
    """A plain module on data without a length (checked each step): rank 1's hook raises after
    the run's last step, with checkpoint_dir: raised on every rank before the final save."""
    return _hook_error(rank, world, out, ddp=False, sized=False, batches=2, epochs=1, fail_after=2,
                       raises={1: _tracker_error})


def plain_hook_oom(rank: int, world: int, out: Path) -> dict:
    """A plain module: rank 1's hook (an evaluation) runs out of memory after step 1: that OOM is
    not the next step's (no replay at a smaller micro-batch), it is raised as itself."""
    def oom() -> Exception:
        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 1's evaluation)")

    return _hook_error(rank, world, out, ddp=False, sized=True, batches=3, epochs=1, fail_after=1,
                       raises={1: oom}, linger=False)


def ddp_hook_last(rank: int, world: int, out: Path) -> dict:
    """DDP without checkpoint_dir: rank 1's hook raises after the run's last step (rank 0 used to
    return as if the run were fine); then a run whose hook raises on every rank after step 1:
    each raises its own error at once."""
    last = _hook_error(rank, world, out / "last", ddp=True, sized=True, batches=2, epochs=1, fail_after=2,
                       raises={1: _tracker_error}, checkpoints=False, linger=False)
    every = _hook_error(rank, world, out / "every", ddp=True, sized=True, batches=2, epochs=1, fail_after=1,
                        raises={0: lambda: KeyError("rank 0's metric"), 1: _tracker_error}, checkpoints=False,
                        linger=False)
    return {"last": last, "every": every}


def hook_save_fails(rank: int, world: int, out: Path) -> dict:
    """``runner.save(path)`` in ``on_step_end`` (every rank: it is collective) where rank 0 cannot
    write ``path``: the save's sync point tells every rank (rank 0 its ``OSError``, rank 1 a
    ``PeerFailedError``), so rank 0's error is raised at once, not carried to a next step that
    rank 1 will not come to."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "blocker").write_text("a file where the checkpoint's directory should be")
    data = [_share(batch, rank, world) for batch in make_data(96, 48)]
    model = _ddp_linear()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=48, micro_batch=12, **QUIET)
    report = _outcome(lambda: runner.fit(data, on_step_end=lambda info: runner.save(out / "blocker" / "last.pt")),
                      linger=False)
    return {**report, "step": runner.step}


def _bn_ddp(find_unused: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()
    return model, torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)


def eval_on_rank0(rank: int, world: int, out: Path) -> dict:
    """A BatchNorm model under DDP (through its reducer, and through its local module with
    find_unused_parameters=True) whose ``on_step_end`` evaluates the DDP model on rank 0 alone
    (``eval()``, ``no_grad``), and rank 0 evaluates it again after ``fit``:
    DDP's forward broadcast rank 0's buffers on rank 0 alone (the ranks waited out the deadline).
    Reports the evaluations, and each rank's parameters and buffers after ``fit``."""
    data = [_share(batch, rank, world) for batch in make_data(64, 16)]
    reports = {}
    for find_unused in (False, True):
        model, ddp = _bn_ddp(find_unused)
        runner = Runner(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8, **QUIET)
        evaluations: list[float] = []

        def evaluate() -> None:
            ddp.eval()
            with torch.no_grad():
                evaluations.append(mse(ddp, data[0]).item())
            ddp.train()

        def fit() -> int:
            steps = runner.fit(data, on_step_end=lambda info: rank == 0 and evaluate()).steps
            if rank == 0:
                evaluate()
            return steps

        report = _outcome(fit, linger=False)
        state = [t.detach().tolist() for t in [*model.parameters(), *model.buffers()]]
        reports["local" if find_unused else "reducer"] = {**report, "evaluations": evaluations, "state": state}
    return reports


def compiled_ddp(rank: int, world: int, out: Path) -> dict:
    """``Runner(torch.compile(DDP(model)))``: what it warns (it trains DDP's module, uncompiled)."""
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("autobatch").addHandler(handler)
    try:
        model = torch.compile(_ddp_linear())
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=48, micro_batch=12, **QUIET)
    finally:
        logging.getLogger("autobatch").removeHandler(handler)
    return {"warnings": warned}


def fit_arguments_differ(rank: int, world: int, out: Path) -> dict:
    """``Runner`` arguments that differ on rank 1 (a DDP model): ``global_batch`` (each rank
    weighted the one all-reduced gradient by its own), ``max_grad_norm`` (each clipped it by its
    own): the ranks' weights silently came apart; ``checkpoint_every``: rank 0 waited alone at
    the first save until the deadline. Each must be one ``ValueError`` on every rank, before a step."""
    data = [_share(batch, rank, world) for batch in make_data(96, 48)]
    reports = {}
    for name, differs in (("global_batch", dict(global_batch=96)), ("max_grad_norm", dict(max_grad_norm=0.5)),
                          ("checkpoint_every", dict(checkpoint_every=1))):
        model = _ddp_linear()
        before = [t.detach().clone() for t in model.parameters()]
        kwargs = dict(global_batch=48, micro_batch=12, checkpoint_dir=out / name, **QUIET) | (differs if rank == 1 else {})
        runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, **kwargs)
        reports[name] = _outcome(lambda: runner.fit(data) and None)
        reports[name]["trained"] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return reports


SCENARIOS = {"ddp_draw_error": ddp_draw_error, "stream_draw_error": stream_draw_error,
             "plan_draw_error": plan_draw_error, "probe_plain_error": probe_plain_error, "probe_module_error": probe_module_error,
             "fsdp_resume_bad_shard": fsdp_resume_bad_shard, "store_late_peer": store_late_peer,
             "ddp_multiple": ddp_multiple, "ddp_hook_error": ddp_hook_error, "stream_hook_last": stream_hook_last,
             "plain_hook_oom": plain_hook_oom, "ddp_hook_last": ddp_hook_last,
             "hook_save_fails": hook_save_fails, "eval_on_rank0": eval_on_rank0,
             "compiled_ddp": compiled_ddp, "fit_arguments_differ": fit_arguments_differ}

if __name__ == "__main__":
    main(SCENARIOS)
