"""A step that does not finish leaves nothing behind: not its random numbers, not its update.

* A replay after an OOM draws the failed attempt's random numbers again (the step's start is
  rewound: torch's CPU generator and the model's accelerator's), so a model with dropout ends
  with the uninjected run's weights; on one process and on two DDP ranks.
* Any other exception inside a global step (a ``KeyboardInterrupt``, an error in ``loss_fn`` or
  ``scheduler.step()``) puts weights, optimizer, scheduler, buffers, random state and a grow
  try back to the step's start before it propagates, unchanged: ``save()`` then resume, or a
  second ``fit()``, apply every update once. With ``step_guard="off"`` (nothing to undo with)
  an update that may be in the weights makes ``save()`` and ``fit()`` refuse, in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autobatch
from autobatch import Runner

GLOBAL, MICRO = 16, 8


def dropout_model(bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if bn else []
    return nn.Sequential(nn.Linear(6, 16), *norm, nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1)).double()


def data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(64, 1, generator=generator, dtype=torch.float64)
    return [(x[i : i + GLOBAL], y[i : i + GLOBAL]) for i in range(0, 64, GLOBAL)]


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def state(runner: Runner) -> dict[str, torch.Tensor]:
    """Weights, buffers and the optimizer's step counters and moments, by name."""
    found = {f"model.{k}": v.detach().clone() for k, v in runner.model.state_dict().items()}
    for index, entry in runner.optimizer.state_dict()["state"].items():
        found.update({f"opt.{index}.{k}": torch.as_tensor(v).clone() for k, v in entry.items()})
    return found


def assert_same(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.allclose(mine[name].double(), value.double(), rtol=1e-10, atol=1e-12), name


def runner_for(model, loss_fn=mse, **options) -> Runner:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    options = {"global_batch": GLOBAL, "micro_batch": MICRO, "grow_after": None, "progress": False, **options}
    return Runner(model, optimizer, loss_fn, **options)


def trained(**options) -> dict:
    runner = runner_for(dropout_model(), **options)
    torch.manual_seed(5)
    runner.fit(data(), epochs=3)
    return state(runner)


# -- 1. a replay draws the same random numbers --------------------------------------------------------
@pytest.mark.parametrize("fault, times", [((2, "backward"), 1), ((5, "optimizer"), 1), ((4, "backward"), 2)])
def test_a_replay_with_dropout_ends_with_the_uninjected_runs_weights(fault, times):
    """The failed attempt drew dropout masks; without rewinding the generators the replay drew
    others and the weights ended 0.08 away."""
    assert_same(trained(faults=autobatch.FaultInjector(fault, times=times)), trained())


def test_a_failed_grow_try_with_dropout_replays_the_same_masks():
    """Micro-batches above 8 never fit: every grow try to 16 fails after its forward drew masks."""
    def small_only(model, batch):
        out = model(batch[0])
        if batch[0].shape[0] > MICRO:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return nn.functional.mse_loss(out, batch[1])

    runner = runner_for(dropout_model(), small_only, max_micro_batch=GLOBAL, grow_after=2)
    torch.manual_seed(5)
    result = runner.fit(data(), epochs=3)
    assert [a["held"] for a in result.grow_attempts] == [False, False]
    assert_same(state(runner), trained())


WORKER = Path(__file__).with_name("dropout_ranks_worker.py")


def test_two_ddp_ranks_replay_the_same_dropout_masks(tmp_path):
    """2 gloo ranks, DDP with dropout seeded per rank, an OOM on rank 1 in backward (rank 0
    replays through PeerOutOfMemoryError): the weights equal the uninjected run's on both ranks."""
    from conftest import cli_env

    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    ranks = [
        subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=cli_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for rank in range(2)
    ]
    try:
        logs = [process.communicate(timeout=240)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), logs[rank][-3000:]
        report = json.loads(path.read_text())
        assert report["recoveries"] == 1, report
        assert report["max_diff"] <= 1e-12, report


# -- 3. an interrupted step is undone -----------------------------------------------------------------
def interrupting(runner: Runner, when) -> dict:
    """Arrange for a KeyboardInterrupt where ``when(runner, phase)`` says, once."""
    fired = {"done": False}

    def faults(step, phase):
        if not fired["done"] and when(step, phase):
            fired["done"] = True
            raise KeyboardInterrupt
    runner.faults = faults
    return fired


@pytest.mark.parametrize("then", ["save and resume", "fit again"])
@pytest.mark.parametrize("where", ["after the optimizer step", "between micro-batches"])
def test_an_interrupted_step_is_applied_once(tmp_path, where, then):
    """Interrupted right after step 2's optimizer.step() (a post-hook), or in step 2's second
    forward (BatchNorm and dropout ran once): the run that goes on applies step 2 once,
    Adam counts 12 steps, BatchNorm 24 batches, and the weights are the uninterrupted run's."""
    def build():
        runner = runner_for(dropout_model(bn=True), checkpoint_dir=tmp_path)
        torch.manual_seed(5)
        return runner

    reference = build()
    reference.fit(data(), epochs=3)
    runner = build()
    if where == "after the optimizer step":
        applied = []

        def post_hook(*_):
            applied.append(1)
            if len(applied) == 3:  # step 2's update is in the weights and Adam's state
                raise KeyboardInterrupt
        runner.optimizer.register_step_post_hook(post_hook)
    else:
        forwards = []

        def second_forward(step, phase):
            forwards.extend([1] if (step, phase) == (2, "forward") else [])
            return len(forwards) == 2  # the first micro-batch's forward and backward ran
        interrupting(runner, second_forward)
    with pytest.raises(KeyboardInterrupt):
        runner.fit(data(), epochs=3)
    assert runner.step == 2 and not runner._stepping
    if then == "save and resume":
        runner.save()
        runner = build()
        runner.fit(data(), epochs=3, resume=tmp_path)
    else:
        runner.fit(data(), epochs=3)
    assert runner.step == 12
    assert int(next(iter(runner.optimizer.state.values()))["step"]) == 12
    assert int(runner.model[1].num_batches_tracked) == 24
    assert_same(state(runner), state(reference))


class FailingOnce(torch.optim.lr_scheduler.StepLR):
    """A StepLR whose step() fails at step ``at`` while ``fail`` (a list, outside its state)
    holds True, after counting the step (as a scheduler whose get_lr raises does)."""

    def __init__(self, optimizer, at, fail):
        self.at, self.fail = at, fail
        super().__init__(optimizer, step_size=2, gamma=0.5)

    def get_lr(self):
        if self.last_epoch == self.at and self.fail[0]:
            self.fail[0] = False
            raise ValueError("scheduler failed")
        return super().get_lr()


def test_an_error_in_scheduler_step_undoes_the_step_and_propagates_unchanged():
    def build(fail):
        model = dropout_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        runner = Runner(model, optimizer, mse, global_batch=GLOBAL, micro_batch=MICRO, grow_after=None, progress=False,
                        scheduler=FailingOnce(optimizer, at=4, fail=[fail]))
        torch.manual_seed(5)
        return runner

    reference = build(fail=False)
    reference.fit(data(), epochs=3)
    runner = build(fail=True)
    with pytest.raises(ValueError, match="^scheduler failed$"):
        runner.fit(data(), epochs=3)
    assert runner.step == 3 and runner.scheduler.last_epoch == 3
    runner.fit(data(), epochs=3)
    assert runner.scheduler.last_epoch == reference.scheduler.last_epoch == 12
    assert runner.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    assert_same(state(runner), state(reference))


def test_an_interrupted_grow_try_goes_back_to_the_size_that_worked():
    runner = runner_for(dropout_model(), max_micro_batch=GLOBAL, grow_after=2)
    interrupting(runner, lambda step, phase: step == 2 and phase == "backward")
    with pytest.raises(KeyboardInterrupt):
        runner.fit(data(), epochs=1)
    assert runner.micro_batch == MICRO and not runner.growth.trying and runner.result.grow_attempts == []
    result = runner.fit(data(), epochs=1)
    assert [(a["step"], a["to"], a["held"]) for a in result.grow_attempts] == [(2, GLOBAL, True)]


def test_with_step_guard_off_an_update_that_cannot_be_undone_is_never_saved(tmp_path):
    """Interrupted after step 2's optimizer.step() began, with no copy to undo it: save() and
    fit() refuse (the last checkpoint stays that of step 2's start), a resume goes on."""
    runner = runner_for(dropout_model(), step_guard="off", checkpoint_dir=tmp_path, checkpoint_every=2)

    fired = []

    def post_hook(*_):
        if runner.step == 2 and not fired:
            fired.append(1)
            raise KeyboardInterrupt
    runner.optimizer.register_step_post_hook(post_hook)
    with pytest.raises(KeyboardInterrupt):
        runner.fit(data(), epochs=1)
    before = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(RuntimeError, match=r"save\(\) refused: global step 2 stopped after its optimizer.step\(\) began, "
                                           r"with step_guard='off'.*Resume from the last checkpoint"):
        runner.save()
    with pytest.raises(RuntimeError, match=r"fit\(\) refused"):
        runner.fit(data(), epochs=1)
    assert (tmp_path / "last.pt").read_bytes() == before
    assert runner.fit(data(), epochs=1, resume=tmp_path).steps == 4


def test_with_step_guard_off_a_step_interrupted_before_its_update_still_saves(tmp_path):
    runner = runner_for(dropout_model(), step_guard="off", checkpoint_dir=tmp_path)
    interrupting(runner, lambda step, phase: step == 2 and phase == "backward")
    with pytest.raises(KeyboardInterrupt):
        runner.fit(data(), epochs=1)
    runner.save()
    assert runner.fit(data(), epochs=1).steps == 4
