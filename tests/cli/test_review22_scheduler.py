"""Review 22: the ``scheduler`` config group of ``python -m autobatch train``.

There was no way to pick a learning-rate schedule from the command line. ``scheduler=cosine``,
``linear_warmup``, ``step`` (each with ``warmup_steps``; ``total_steps`` null: the run's length)
and ``target`` (any ``LRScheduler`` by import path) now build one that the runner steps once per
optimizer step and keeps in checkpoints; ``scheduler=none`` is the default. A bad name or value
is one line naming the key.
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch import Runner
from autobatch.cli import preflight
from autobatch.cli.build import validate
from autobatch.cli.errors import CLIError
from autobatch.cli.loss import cross_entropy_loss
from autobatch.cli.schedulers import WarmupCosineLR, build_scheduler
from autobatch.training.oom.faults import FaultInjector

SMALL = ["model=mlp", "data.shape=[4]", "model.width=8"]


@pytest.fixture
def conf():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        yield lambda *overrides: compose("train", overrides=[*SMALL, *overrides])


def _runner(scheduler_cfg, tmp_path, *, faults=None, run_steps=6):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(scheduler_cfg.optimizer.lr))
    scheduler = build_scheduler(scheduler_cfg, optimizer, run_steps)
    runner = Runner(model, optimizer, cross_entropy_loss, global_batch=8, micro_batch=4, device="cpu", grow_after=None,
                    scheduler=scheduler, faults=faults, checkpoint_dir=tmp_path)
    return runner, optimizer, scheduler


def _data(batches=6):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for _ in range(batches)]


def test_cosine_with_warmup_steps_once_per_update_through_an_oom_replay_and_accumulation(conf, tmp_path):
    cfg = conf("scheduler=cosine", "scheduler.warmup_steps=2", "scheduler.min_lr=0.0001", "train.lr=0.01",
               "train.steps=6")
    validate(cfg)
    runner, optimizer, scheduler = _runner(cfg, tmp_path, faults=FaultInjector([(1, "backward"), (3, "optimizer")]))
    assert isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps == 6  # null total_steps: the run's length
    seen = []
    runner.fit(_data(), steps=6, on_step_end=lambda info: seen.append(optimizer.param_groups[0]["lr"]))
    assert len(runner.result.oom_recoveries) == 2 and runner.result.micro_batch < runner.result.global_batch  # accumulated
    assert scheduler.last_epoch == 6  # six updates, six scheduler steps: no replay or micro-batch stepped it
    def expected(step):  # the learning rate after `step` updates
        if step < 2:
            return 0.01 * (step + 1) / 2
        return 1e-4 + (0.01 - 1e-4) * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 2) / 4)))
    assert seen == pytest.approx([expected(step) for step in range(1, 7)])


def test_the_schedule_is_saved_and_a_resumed_run_goes_on_where_it_stopped(conf, tmp_path):
    cfg = conf("scheduler=step", "scheduler.step_size=2", "scheduler.gamma=0.5", "scheduler.warmup_steps=1")
    whole, optimizer, _ = _runner(cfg, tmp_path / "whole")
    whole.fit(_data(), steps=6)
    first, _, _ = _runner(cfg, tmp_path / "part")
    first.fit(_data(), steps=3)
    first.save()
    resumed, resumed_optimizer, resumed_scheduler = _runner(cfg, tmp_path / "part")
    resumed.fit(_data(), steps=6, resume=tmp_path / "part" / "last.pt")
    assert resumed_scheduler.last_epoch == 6
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** ((6 - 1) // 2))


@pytest.mark.parametrize(("overrides", "message"), [
    (["scheduler=cosine", "scheduler.warmup_steps=30", "train.steps=20"],
     "scheduler.warmup_steps=30 leaves no step of the schedule after it"),
    (["scheduler=step", "scheduler.gamma=2"], "scheduler.gamma must be in (0, 1]"),
    (["scheduler=target"], "needs gamma; give +scheduler.gamma=VALUE"),
    (["scheduler=target", "scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"],
     "scheduler._target_=ReduceLROnPlateau needs a metric"),
])
def test_a_bad_schedule_is_one_line_naming_the_key_before_anything_runs(conf, overrides, message):
    with pytest.raises(ValueError, match="^scheduler") as raised:
        validate(conf(*overrides))
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(("args", "fix"), [
    (["scheduler.warmup_steps=3"], "choose one first: scheduler=cosine scheduler.warmup_steps=3"),
    (["scheduler=Cosine"], "Available options in 'scheduler': cosine linear_warmup none step target (did you mean "
                           "scheduler=cosine?)"),
    (["-m", "scheduler=cosine", "scheduler.warmup_steps=20", "train.steps=40,10"],  # which job of the sweep
     "job 1 (train.steps=10): scheduler.warmup_steps=20 leaves no step"),
])
def test_a_key_of_the_default_none_a_misspelt_option_or_a_sweeps_bad_job_names_the_fix(args, fix):
    with pytest.raises(CLIError) as raised:
        preflight.check("train", args)
    assert fix in raised.value.message


def test_a_target_scheduler_gets_the_runs_length_as_its_total_steps(conf, tmp_path):
    cfg = conf("scheduler=target", "scheduler._target_=torch.optim.lr_scheduler.OneCycleLR", "+scheduler.max_lr=0.1")
    validate(cfg)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = build_scheduler(cfg, optimizer, run_steps=7)
    assert isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) and scheduler.total_steps == 7
    assert build_scheduler(conf(), optimizer, run_steps=7) is None  # scheduler=none, the default
    assert build_scheduler(OmegaConf.create({"train": {"steps": 3}}), optimizer, 3) is None  # an older config


def test_train_hands_the_schedule_to_the_runner_over_the_epochs_length(conf, tmp_path):
    from autobatch.cli.build import build_workload
    from autobatch.cli.training import run_training

    cfg = conf("scheduler=linear_warmup", "scheduler.warmup_steps=1", "train.epochs=2", "data.num_samples=24",
               "device=cpu", "train.progress=false", "probe.memory_limit=null", "device.simulated_budget=null")
    _, runner = run_training(cfg, build_workload(cfg), global_batch=8, micro_batch=8, out_dir=tmp_path)
    assert runner.scheduler.total_steps == 6 and runner.scheduler.last_epoch == 6  # 2 epochs of 3 batches
    assert runner.optimizer.param_groups[0]["lr"] == 0.0  # decayed to min_lr at the run's end


@pytest.mark.parametrize(("overrides", "give"), [
    ([], "trained with scheduler WarmupCosineLR and this run builds none; give scheduler=cosine"),
    (["scheduler=step"], "this run builds WarmupStepLR; give scheduler=cosine"),
])
def test_a_resume_that_leaves_out_or_changes_the_schedule_names_the_option(conf, overrides, give):
    from autobatch.cli.resume_state import check_optimizer_kind

    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    state = {"optimizer_type": "AdamW", "scheduler_type": "WarmupCosineLR"}
    with pytest.raises(ValueError, match="^train.resume: ") as raised:
        check_optimizer_kind(state, optimizer, "last.pt", conf(*overrides))
    assert give in str(raised.value)
    check_optimizer_kind(state, optimizer, "last.pt", conf("scheduler=cosine"))  # the run's own: resumed
    check_optimizer_kind({"optimizer_type": "AdamW"}, optimizer, "last.pt", conf())  # an older checkpoint


def test_review33_sequential_lr_builds_its_nested_schedulers_with_the_optimizer(conf):
    # Hydra built the nested nodes without the optimizer: the run stopped after its probe on LinearLR's
    # "missing ... 'optimizer'", advised to give +scheduler.optimizer=VALUE, which no command line can
    lr = torch.optim.lr_scheduler
    cfg = conf("scheduler=target", "scheduler._target_=torch.optim.lr_scheduler.SequentialLR", "+scheduler.milestones=[2]",
               "+scheduler.schedulers=[{_target_:torch.optim.lr_scheduler.LinearLR,start_factor:0.1,total_iters:2},"
               "{_target_:torch.optim.lr_scheduler.ExponentialLR,gamma:0.5}]")
    built, reference = (torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0) for _ in range(2))
    scheduler = build_scheduler(cfg, built, run_steps=5)
    expected = lr.SequentialLR(reference, [lr.LinearLR(reference, start_factor=0.1, total_iters=2),
                                           lr.ExponentialLR(reference, gamma=0.5)], milestones=[2])
    rates = []
    for _ in range(5):
        built.step(), reference.step(), scheduler.step(), expected.step()
        rates.append((built.param_groups[0]["lr"], reference.param_groups[0]["lr"]))
    assert isinstance(scheduler, lr.SequentialLR) and all(a == b for a, b in rates)
    bad = conf("scheduler=target", "scheduler._target_=torch.optim.lr_scheduler.ChainedScheduler",
               "+scheduler.schedulers=[{_target_:torch.optim.lr_scheduler.ExponentialLR}]")
    with pytest.raises(ValueError, match=r"give scheduler.schedulers\[0\] gamma: VALUE"):
        build_scheduler(bad, built, run_steps=5)
