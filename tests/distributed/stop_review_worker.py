"""One rank of ``test_stop_review.py`` (gloo, CPU): stop requests at awkward moments.

Run as ``python tests/distributed/stop_review_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (``rank_worker.py``). Each
scenario reports what every rank saw, so the test can compare the ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]

from autobatch import Runner, inject_oom  # noqa: E402
from lockstep_worker import _batches, _model, _mse  # noqa: E402
from rank_worker import main  # noqa: E402
from stop_worker import SCENARIOS as ONE_RANK_ASKS, _weights  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)


class Unsized:
    """Batches without a length: the ranks check every step that each has one."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _runner(kind: str = "plain", loss_fn=_mse, **options) -> Runner:
    model = _model(kind)
    options = {"micro_batch": 4, **QUIET, **options}
    return Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn, global_batch=16, **options)


def _asking_in_step(kind: str, rank: int, at: int, **options) -> Runner:
    """A runner whose loss function asks for a stop on rank 1 inside step ``at``'s forward
    (before the step's votes, which carry it)."""
    box: list[Runner] = []

    def loss_fn(model, batch):
        if rank == 1 and box[0].step + 1 == at:
            box[0].request_stop()
        return _mse(model, batch)

    box.append(_runner(kind, loss_fn, **options))
    return box[0]


def _resumed_same(kind, data, out, epochs=2, steps=None, oom_on=None, **options):
    """A run never stopped (with the same injected OOM) and one resumed from ``out``: the
    resumed run's steps, and whether its weights equal the uninterrupted run's exactly."""
    reference = _runner(kind, **options)
    if oom_on is not None:
        inject_oom(reference, at=oom_on)
    reference.fit(data, epochs=epochs, steps=steps)
    resumed = _runner(kind, **options)
    finished = resumed.fit(data, epochs=epochs, steps=steps, resume=out)
    return {"resumed_steps": finished.steps, "same_weights": torch.equal(_weights(reference.model), _weights(resumed.model))}


def _report(result, runner):
    return {"stopped": result.stopped, "steps": result.steps, "epochs": result.epochs, "position": runner.position,
            "recoveries": len(result.oom_recoveries)}


def last_step_in_forward(rank, world, out):
    """steps=4, rank 1 asks inside step 4 (carried by its vote)."""
    runner = _asking_in_step("plain", rank, 4, checkpoint_dir=out)
    result = runner.fit(_batches(128, 16, rank, 2), steps=4)
    report = _report(result, runner)
    again = runner.fit(_batches(128, 16, rank, 2), steps=8)
    report["again"] = _report(again, runner)
    return report


def last_step_in_hook(rank, world, out):
    """steps=4, rank 1 asks in step 4's hook (after its last sync point): the save carries it."""
    runner = _runner(checkpoint_dir=out)
    result = runner.fit(_batches(128, 16, rank, 2), steps=4,
                        on_step_end=lambda info: runner.request_stop() if rank == 1 and info["step"] == 4 else None)
    report = _report(result, runner)
    again = runner.fit(_batches(128, 16, rank, 2), steps=8)
    report["again"] = _report(again, runner)
    return report


def _asked_after(step: int, sized: bool, rank: int, out):
    """Two epochs of 8 steps, rank 1 asking for a stop after ``step``; sized data or data without
    a length (a sync point before each step); then a resume from the checkpoint."""
    data = _batches(128, 16, rank, 2)
    data = data if sized else Unsized(data)
    runner = _runner(checkpoint_dir=out)
    result = runner.fit(data, epochs=2,
                        on_step_end=lambda info: runner.request_stop() if rank == 1 and info["step"] == step else None)
    return {**_report(result, runner), **_resumed_same("plain", data, out)}


def unsized(rank, world, out):
    """Data without a length: rank 1 asks after step 3."""
    return _asked_after(3, False, rank, out)


def unsized_epoch_end(rank, world, out):
    """Data without a length: rank 1 asks after step 7, so the stop falls on the epoch's last batch."""
    return _asked_after(7, False, rank, out)


def epoch_end(rank, world, out):
    """Sized data: the stop falls on the epoch's last batch, which counts the epoch."""
    return _asked_after(7, True, rank, out)


def _oom_replay(kind, rank, out):
    """rank 0 runs out of memory in step 4's backward (replayed); rank 1 asks in step 4's forward."""
    data = _batches(128, 16, rank, 2)
    runner = _asking_in_step(kind, rank, 4, checkpoint_dir=out)
    oom = (3, "backward") if rank == 0 else None
    if oom is not None:
        inject_oom(runner, at=oom)
    result = runner.fit(data, epochs=2)
    return {**_report(result, runner), **_resumed_same(kind, data, out, oom_on=oom)}


def oom_replay(rank, world, out):
    return _oom_replay("plain", rank, out)


def planned(rank, world, out):
    """micro_batch=None: rank 1 asks before fit; the plan's sync points carry it."""
    data = _batches(128, 16, rank, 2)
    runner = _runner(micro_batch=None, plan_options={"memory_limit": "8MiB"}, checkpoint_dir=out)
    if rank == 1:
        runner.request_stop()
    result = runner.fit(data, epochs=2)
    return _report(result, runner)


def second_fit(rank, world, out):
    """A stopped fit, then a second fit() of the same runner that trains on to the end."""
    data = _batches(128, 16, rank, 2)
    reference = _runner()
    reference.fit(data, epochs=2)
    runner = _runner()
    first = runner.fit(data, epochs=2,
                       on_step_end=lambda info: runner.request_stop() if rank == 1 and info["step"] == 3 else None)
    report = _report(first, runner)
    second = runner.fit(data, epochs=2)
    report["again"] = _report(second, runner)
    report["same_weights"] = torch.equal(_weights(reference.model), _weights(runner.model))
    return report


def fsdp_oom(rank, world, out):
    return _oom_replay("fsdp", rank, out)


# test_stop_ranks.py's scenarios too: one launch for both files (launch_stop_scenarios)
SCENARIOS = {**ONE_RANK_ASKS, **{f.__name__: f for f in (
    last_step_in_forward, last_step_in_hook, unsized, unsized_epoch_end, epoch_end, oom_replay, planned, second_fit,
    fsdp_oom)}}


if __name__ == "__main__":
    main(SCENARIOS)
