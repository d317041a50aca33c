"""Review 32: a user's own optimizer, scheduler and loss, as Hydra users write them.

``_partial_: true`` on an optimizer or scheduler (the lightning-hydra-template's convention: the
program fills in the parameters, the optimizer) stopped the run on "built a
hydra._internal.target_policy._DeferredTarget, not a torch.optim.Optimizer", which named neither
``_partial_`` nor what to change. autobatch is the program that fills them in, so the node is
built whole (docs/cli.md, "Your own config").

A loss of one's own given elsewhere than the ``loss`` group (``train.loss=mypkg.my_loss``), or as
an option (``loss=mypkg.my_loss``), is one line naming ``loss._target_`` (docs/cli.md, "Losses").

``probe --config-name mytrain`` (a config extending ``train``, which serves both commands) ran as
a job named ``train``: its log was ``train.log`` and a probe sweep's summary had ``train`` 's
columns (``steps``, ``recoveries``, ``final_loss``, always empty). The dispatcher names the job by
its command.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.construct import construct
from autobatch.cli.schedulers import build_scheduler


@pytest.fixture
def composed():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        yield lambda *overrides: compose("train", overrides=["device=cpu", *overrides])


def test_review32_partial_optimizer_and_scheduler_are_built_whole(composed):
    cfg = composed("optimizer=target", "optimizer._target_=torch.optim.AdamW", "+optimizer._partial_=true",
                   "train.lr=0.05", "scheduler=target", "scheduler._target_=torch.optim.lr_scheduler.StepLR",
                   "+scheduler.step_size=2", "+scheduler._partial_=true")
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = construct("optimizer", cfg.optimizer, expect=torch.optim.Optimizer, params=[weight])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 0.05  # ${train.lr}
    scheduler = build_scheduler(cfg, optimizer, 10)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.step_size == 2



def test_review32_a_loss_of_ones_own_is_told_where_it_goes(composed):
    """``train.loss=mypkg.my_loss`` was "train has no key 'loss'", ``loss=mypkg.my_loss`` Hydra's "Could
    not find 'loss/mypkg.my_loss'": neither named the ``loss`` group's ``loss._target_``."""
    from autobatch.cli.override_hints import override_hint
    from autobatch.cli.schema_keys import check_unknown_keys

    advice = "the loss is the top-level loss group: loss=cross_entropy (the default) or loss=mse, or any criterion"
    with pytest.raises(ValueError) as raised:
        check_unknown_keys(composed("+train.loss=mypkg.my_loss"))
    assert str(raised.value).startswith(f"+train.loss: {advice}") and "+loss._partial_=true" in str(raised.value)
    said = override_hint("Could not override 'train.loss'. To append to your config use +train.loss=mypkg.my_loss")
    assert said.startswith(f"Could not override 'train.loss': train has no key 'loss'; {advice}"), said
    option = override_hint("In 'train': Could not find 'loss/mypkg.my_loss' Available options in 'loss': cross_entropy mse")
    assert option.endswith("(loss=mypkg.my_loss names no option; a loss of your own by import path: loss._target_="
                           "mypkg.my_loss (+loss._partial_=true for a function of (output, target)))"), option


def test_review32_a_train_config_given_to_probe_runs_a_job_named_probe(composed):
    from autobatch.cli.sweep import COMMAND_COLUMNS, PLAN_COLUMNS, _empty_columns
    from autobatch.cli.user_config import job_name_override

    args = ["--config-dir", "myconf", "--config-name", "mytrain", "-m", "model.hidden=8,16", "train.global_batch=64"]
    added = job_name_override("probe", args)
    assert added == ["hydra.job.name=probe"]
    assert job_name_override("probe", ["model=mlp"]) == [] == job_name_override("probe", [*args, "hydra.job.name=mine"])
    with_name = compose("train", overrides=["device=cpu", "train.global_batch=64", *added], return_hydra_config=True)
    columns = _empty_columns(str(with_name.hydra.job.name), with_name)  # a sweep row's columns
    assert list(columns) == [*COMMAND_COLUMNS["probe"], *PLAN_COLUMNS]
