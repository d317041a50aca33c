"""``python -m autobatch train`` as a user runs it next (review 20b).

* Resuming with another learning rate (``train.lr=0.5 train.resume=latest``): the runner loads
  the checkpoint's optimizer state, its settings included, and told the user only in a log
  warning to "set them after resuming", which the command line cannot do. The run's notes
  (console and ``train_result.json``) now name the keys and the values kept.
* Resuming a run trained with ``optimizer=sgd`` by a command without it (the default
  ``adamw``) said "resume with SGD": it now names the override, ``optimizer=sgd``.
* The summary said ``global batch 20 = micro-batch 7 x 3`` (21 samples); it now lists the
  sizes the runner cut the batch into where they are not all the micro-batch.
* ``model._target_=mymodels.MyNte`` said only "has no attribute 'MyNte'"; it now names the
  closest name there (``did you mean mymodels.MyNet?``).
* A dataset with float targets (a regression) failed with PyTorch's dtype error raised inside
  autobatch's loss; it now says the CLI's loss takes integer class ids.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from autobatch import Runner
from autobatch.cli.build import locate
from autobatch.cli.display import print_training
from autobatch.cli.loss import cross_entropy_loss
from autobatch.cli.resume_state import check_optimizer_kind, kept_settings, read_checkpoint


@pytest.fixture(scope="module")
def sgd_checkpoint(tmp_path_factory):
    """A runner checkpoint of one step of a tiny model under SGD(lr=0.1, momentum=0.9)."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    runner = Runner(model, optimizer, cross_entropy_loss, global_batch=4, micro_batch=4, device="cpu",
                    checkpoint_dir=tmp_path_factory.mktemp("ck"), grow_after=None)
    runner.fit([(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))], steps=1)
    return read_checkpoint(runner.checkpoint_dir / "last.pt")


def _cfg(**optimizer):
    return OmegaConf.create({"train": {"lr": 0.5}, "optimizer": {"_target_": "torch.optim.SGD", **optimizer}})


@pytest.mark.parametrize(("optimizer", "named"), [
    ({"lr": "${train.lr}", "momentum": 0.9}, "train.lr 0.1 (this run: 0.5)"),  # the packaged interpolation
    ({"lr": 0.3, "momentum": 0.5}, "optimizer.lr 0.1 (this run: 0.3), optimizer.momentum 0.9 (this run: 0.5)"),
])
def test_optimizer_settings_a_resume_keeps_are_named_by_their_keys(sgd_checkpoint, optimizer, named):
    cfg = _cfg(**optimizer)
    lr = OmegaConf.to_container(cfg, resolve=True)["optimizer"]["lr"]
    resumed = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=lr, momentum=optimizer["momentum"])
    [note] = kept_settings(sgd_checkpoint, resumed, cfg)
    assert note.startswith(f"kept the checkpoint's optimizer settings: {named}; ")
    assert "start afresh without train.resume" in note
    same = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1, momentum=0.9)
    assert kept_settings(sgd_checkpoint, same, _cfg(lr=0.1, momentum=0.9)) == []


def test_another_optimizer_class_names_the_option_to_give(sgd_checkpoint, tmp_path):
    adamw = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters())
    with pytest.raises(ValueError, match=r"trained with optimizer SGD and this run builds AdamW; give optimizer=sgd "):
        check_optimizer_kind(sgd_checkpoint, adamw, tmp_path / "last.pt")
    adagrad = {**sgd_checkpoint, "optimizer_type": "Adagrad"}
    with pytest.raises(ValueError, match=r"give optimizer=target optimizer._target_=torch.optim.Adagrad "):
        check_optimizer_kind(adagrad, adamw, tmp_path / "last.pt")
    assert kept_settings(adagrad, adamw, _cfg()) == []  # the class error says it; no note on top


@pytest.mark.parametrize(("global_batch", "micro_batch", "sizes", "shown"), [
    (20, 7, [7, 7, 6], "3 micro-batches of at most 7 (sizes 7, 7, 6) in"),
    (23, 4, [4, 4, 4, 4, 4, 3], "6 micro-batches of at most 4 (sizes 4 x 5, 3) in"),
    (21, 7, [7, 7, 7], "micro-batch 7 x 3 in"),
    # balanced: "149777 x 2" read as 299554 samples
    (149778, 149777, [74889, 74889], "2 micro-batches of at most 149777 (sizes 74889, 74889) in"),
])
def test_the_summary_lists_the_sizes_a_micro_batch_does_not_divide(capsys, global_batch, micro_batch, sizes, shown):
    run = SimpleNamespace(steps_this_run=2, steps=2, global_batch=global_batch, micro_batch=micro_batch, elapsed_s=0.1,
                          samples_per_s=10.0, last_loss=None, oom_recoveries=[], checkpointing=False, checkpoint_path=None)
    print_training(run, [], sizes)
    assert f"trained         2 steps (2 in all) of global batch {global_batch} = {shown}" in capsys.readouterr().out


def test_the_summary_counts_one_step_as_one(capsys):
    run = SimpleNamespace(steps_this_run=1, steps=5, global_batch=8, micro_batch=8, elapsed_s=0.1, samples_per_s=80.0,
                          last_loss=None, oom_recoveries=[], checkpointing=False, checkpoint_path=None)
    print_training(run, [], [8])
    assert "trained         1 step (5 in all) of global batch 8 = micro-batch 8 x 1 in" in capsys.readouterr().out


def test_float_targets_say_the_loss_takes_class_ids():
    """A regression dataset's float targets raised PyTorch's "expected target dtype to be Long"
    from inside autobatch; the line now says what the CLI's loss takes."""
    model = torch.nn.Linear(4, 1)
    with pytest.raises(TypeError, match=r"cross-entropy over class ids, but the targets are float32 \(shape \[1\] "
                                        r"a sample\): give integer class ids"):
        cross_entropy_loss(model, (torch.randn(3, 4), torch.randn(3, 1)))


def test_a_misspelt_target_names_the_closest_name_there():
    with pytest.raises(ImportError, match=r"^torch.optim has no attribute 'Adamm'; did you mean torch.optim.Adam\?$"):
        locate("torch.optim.Adamm")
    with pytest.raises(ImportError, match=r"^torch.nn has no attribute 'Zzzzzz'$"):  # nothing close: no guess
        locate("torch.nn.Zzzzzz")


def test_review36_a_scheduled_lr_is_no_kept_setting(tmp_path):
    """A resume of a finished cosine run: the checkpoint's group holds lr 0.0 (the schedule's
    end) and initial_lr 0.1; a run configured with lr 0.1 gets no note, one with 0.5 is told 0.1."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)
    runner = Runner(model, optimizer, cross_entropy_loss, global_batch=4, micro_batch=4, device="cpu",
                    scheduler=scheduler, checkpoint_dir=tmp_path, grow_after=None)
    runner.fit([(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))], steps=1)
    state = read_checkpoint(tmp_path / "last.pt")
    assert state["optimizer_groups"][0]["lr"] == 0.0
    fresh = lambda lr: torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=lr)  # noqa: E731
    cfg = OmegaConf.create({"train": {"lr": 0.1}, "optimizer": {"_target_": "torch.optim.SGD", "lr": "${train.lr}"}})
    assert kept_settings(state, fresh(0.1), cfg) == []
    [note] = kept_settings(state, fresh(0.5), cfg)
    assert note.startswith("kept the checkpoint's optimizer settings: train.lr 0.1 (this run: 0.5); ")
