"""Review 23: ``metrics.jsonl`` records the learning rate each optimizer step was applied at.

A user plotting a schedule from ``metrics.jsonl`` found no ``lr`` in it. Each line now has
``lr``: the first param group's rate when every group has the same, else one per group; read when
the update is applied (the runner steps the schedule after the update, so the optimizer then
already holds the next step's rate).
"""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import build_workload, validate
from autobatch.cli.lr_record import StepLearningRates, group_lrs
from autobatch.cli.training import METRICS, run_training

RUN = ["model=mlp", "data.shape=[4]", "model.width=8", "data.num_samples=32", "train.steps=4", "device=cpu",
       "train.progress=false", "train.grow_after=0", "probe.memory_limit=null", "device.simulated_budget=null"]


def test_each_metrics_line_has_the_rate_its_step_was_applied_at(tmp_path):
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*RUN, "train.lr=0.01", "scheduler=step", "scheduler.step_size=1",
                                          "scheduler.gamma=0.5"])
    validate(cfg)
    run_training(cfg, build_workload(cfg), global_batch=8, micro_batch=8, out_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    # step 1 at lr, then halved after every update: the rate of each step, not of the next one
    assert [line["lr"] for line in lines] == pytest.approx([0.01 * 0.5 ** k for k in range(4)])


def test_groups_with_different_rates_are_listed_and_a_skipped_step_keeps_the_rate_it_would_have_used():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.01}])
    assert group_lrs(optimizer) == [0.1, 0.01]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with StepLearningRates(optimizer) as rates:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
        assert rates.taken() == pytest.approx([0.1, 0.01])
        scheduler.step()  # a step a GradScaler skipped: no optimizer.step(), the schedule still moves on
        assert rates.taken() == pytest.approx([0.05, 0.005])
    assert not optimizer._optimizer_step_pre_hooks  # the hook is removed with the run
