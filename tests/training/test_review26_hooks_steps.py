"""``on_step_end`` as a plain-PyTorch loop's logging, evaluation and early stopping, through OOM replays.

A metric logger in the hook sees each optimizer step once, with the step's own loss, samples,
micro-batch and the learning rate the step applied (``info["lr"]``: the optimizer's own is the
next step's once the runner's scheduler stepped). An evaluation in the hook that forgets
``model.train()`` is put back and warned about; a hook's request to stop says why in the result.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from autobatch import RunResult, Runner
from autobatch.training.oom.faults import FaultInjector

QUIET = dict(progress=False, log_every=None, grow_after=None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data(steps: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator)) for _ in range(steps)]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _logged_run(faults: FaultInjector | None = None) -> tuple[list[dict], RunResult]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    runner = Runner(model, optimizer, _loss, global_batch=8, micro_batch=8, scheduler=scheduler, faults=faults, **QUIET)
    logged: list[dict] = []
    return logged, runner.fit(_data(), on_step_end=logged.append)


def test_hook_sees_each_step_once_with_its_loss_and_lr_through_oom_replays() -> None:
    plain, _ = _logged_run()
    forced, result = _logged_run(FaultInjector([(1, "backward"), (3, "optimizer")]))
    assert [info["step"] for info in forced] == [info["step"] for info in plain] == list(range(1, 7))  # once each
    for mine, theirs in zip(forced, plain):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["samples"] == 8 and mine["micro_batch"] * mine["accumulation"] == 8
        assert mine["lr"] == theirs["lr"] and mine["lrs"] == [mine["lr"]]
    assert [info["lr"] for info in forced] == [0.1 * 0.5**k for k in range(6)]  # the rate each step applied
    assert [info["micro_batch"] for info in forced] == [8, 4, 4, 4, 4, 4]  # the optimizer step's OOM: the same 4
    assert [(r["step"], r["phase"]) for r in result.oom_recoveries] == [(1, "backward"), (3, "optimizer")]
    assert result.samples == sum(info["samples"] for info in forced) == 48 and result.steps == 6


def test_evaluation_in_hook_without_train_is_put_back_and_warned_once(caplog) -> None:
    model = _model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=8, micro_batch=8, **QUIET)
    modes: list[bool] = []

    def evaluate_every_2(info: dict) -> None:
        modes.append(model.training)
        if info["step"] % 2 == 0:
            model.eval()  # ... and no model.train() after it
            with torch.no_grad():
                model(torch.zeros(2, 4))

    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(_data(), on_step_end=evaluate_every_2)
    assert modes == [True] * 6 and model.training  # every step trained in train mode
    assert sum("left the model in eval mode" in r.getMessage() for r in caplog.records) == 1


def test_hook_switching_submodules_only_is_left_alone(caplog) -> None:
    model = _model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=8, micro_batch=8, **QUIET)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(_data(3), on_step_end=lambda info: model[1].eval())  # dropout off on purpose after step 1
    assert model.training and not model[1].training
    assert not any("eval mode" in r.getMessage() for r in caplog.records)


def test_early_stop_from_hook_says_why_and_saves(tmp_path) -> None:
    model = _model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=8, micro_batch=8,
                    checkpoint_dir=tmp_path, **QUIET)
    best = [float("inf")]

    def early_stopping(info: dict) -> None:
        if info["step"] >= 2:
            runner.request_stop(f"no improvement after step {info['step']}")
        best[0] = min(best[0], info["loss"])

    result = runner.fit(_data(), on_step_end=early_stopping)
    assert (result.stopped, result.stop_reason, result.steps) == (True, "no improvement after step 2", 2)
    assert (tmp_path / "last.pt").is_file() and result.checkpoints_saved == 1
    assert RunResult.from_dict(result.to_dict()).stop_reason == result.stop_reason
    runner.request_stop()  # in the run's last step: complete, no reason
    again = runner.fit(_data(), steps=3)
    assert (again.stopped, again.stop_reason) == (False, None)
    with pytest.raises(TypeError, match="reason"):
        runner.request_stop(3)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
@pytest.mark.parametrize("where", ["on_step_end", "loss_fn"])
def test_review36_scheduler_stepped_by_runner_and_user_is_warned(caplog, where: str) -> None:
    # a loop ported with its scheduler.step() kept (in the hook, or in loss_fn at one micro-batch a step) and the
    # scheduler also given as Runner(scheduler=...): stepped twice a step, a 6-step warmup done in 3, without a word
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 6))

    def loss(model, batch):
        if where == "loss_fn":
            scheduler.step()
        return _loss(model, batch)

    runner = Runner(model, optimizer, loss, global_batch=8, micro_batch=8, scheduler=scheduler, **QUIET)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(_data(4), on_step_end=(lambda info: scheduler.step()) if where == "on_step_end" else None)
    warned = [r.message for r in caplog.records if "stepped outside the runner" in r.message]
    assert len(warned) == 1 and "after step 0" in warned[0] and "LambdaLR" in warned[0]  # once, at the first
    caplog.clear()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alone = Runner(model, optimizer, _loss, global_batch=8, micro_batch=8,
                   scheduler=torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=4), **QUIET)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        alone.fit(_data(4), on_step_end=lambda info: None)  # the runner alone steps it: no warning
    assert not [r for r in caplog.records if "stepped outside the runner" in r.message]


def test_review37_evaluation_that_raises_in_the_hook_leaves_the_model_training() -> None:
    """An evaluation in the hook that raises (its OOM) never reached its ``model.train()``: the modes
    are put back before the error propagates, so a later ``fit()`` trains in train mode (it trained
    every step in eval mode, dropout off, without a word)."""
    model = _model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=8, micro_batch=8, **QUIET)

    def evaluate(info: dict) -> None:
        model.eval()
        with torch.no_grad():
            raise torch.OutOfMemoryError("the validation batch")

    with pytest.raises(torch.OutOfMemoryError, match="^the validation batch$"):  # propagated unchanged
        runner.fit(_data(), on_step_end=evaluate)
    modes: list[bool] = []
    runner.fit(_data(), on_step_end=lambda info: modes.append(model.training))
    assert model.training and modes == [True] * 5


def test_review38_result_counts_in_the_hook_are_of_the_step_that_ended() -> None:
    """A hook reading ``runner.result`` saw ``steps`` of before the step (0 in a fresh run: set only by a
    save and at the end), while ``info["step"]`` said the new one; through an OOM replay too, counted once."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = Runner(model, optimizer, _loss, global_batch=8, micro_batch=8, faults=FaultInjector([(1, "backward")]), **QUIET)
    seen: list[tuple] = []
    runner.fit(_data(4), on_step_end=lambda info: seen.append(
        (info["step"], runner.result.steps, runner.result.steps_this_run, runner.result.samples, runner.result.epochs)))
    assert seen == [(step, step, step, 8 * step, 0) for step in range(1, 5)]
    assert (runner.result.steps, runner.result.samples, runner.result.epochs) == (4, 32, 1)
