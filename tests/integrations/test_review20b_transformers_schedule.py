"""Review 20b: ``fit_batch_size`` changes the optimizer steps ``train()`` runs (``num_train_epochs``)
or the samples it trains (``max_steps``), and nothing said so; a warmup given as a count of steps
(``warmup_steps=10``, sized for 64 steps at ``per_device_train_batch_size=2``) became the whole run
at 28 (4 steps, all warmup: the learning rate never reached its peak nor decayed), silently. The
INFO line now names the steps, and an integer warmup or a scheduler passed to the Trainer sized for
another count is one warning. The probe is stubbed to a fixed answer (the probes have their own tests)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402  (64 samples, drop_last)
from test_review19_samples_per_step import _answer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _fit(tmp_path, caplog, monkeypatch, **args):
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(28))
    trainer = make_trainer(tmp_path, PadCollator())
    for name, value in args.items():  # make_trainer sets max_steps=2
        setattr(trainer.args, name, value)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        fit_batch_size(trainer)
    ours = [r for r in caplog.records if r.name.startswith("autobatch")]  # not transformers' own config warnings
    return trainer, [r.getMessage() for r in ours if r.levelno == logging.WARNING], \
        [r.getMessage() for r in ours if r.levelno == logging.INFO][-1]


@pytest.mark.parametrize("warmup, warned", [(10, True), (0.1, False)])
def test_a_warmup_counted_in_steps_of_the_old_batch_is_one_warning(tmp_path, caplog, monkeypatch, warmup, warned):
    trainer, warnings, told = _fit(tmp_path, caplog, monkeypatch, max_steps=-1, num_train_epochs=2, warmup_steps=warmup)
    assert "train() runs 4 optimizer step(s) (2 epoch(s)) where per_device_train_batch_size=2 ran 64" in told
    assert warnings == ([
        "fit_batch_size: warmup_steps=10 was sized for the 64 optimizer steps train() ran at "
        "per_device_train_batch_size=2 (16% of them); at 28 it runs 4, so the warmup is all of them: the learning "
        "rate never reaches its peak nor decays; give the warmup as a share of the run (warmup_steps=0.16 in "
        "Transformers 5, warmup_ratio before) or a count for 4 steps"] if warned else [])
    if not warned:  # the count said is the one train() runs
        trainer.train()
        assert trainer.state.max_steps == trainer.state.global_step == 4


def test_max_steps_says_the_samples_and_a_scheduler_passed_in_is_one_warning(tmp_path, caplog, monkeypatch):
    _, warnings, told = _fit(tmp_path, caplog, monkeypatch, max_steps=6, warmup_steps=2)
    assert warnings == [] and "train() runs 6 optimizer step(s) (3 epoch(s)), 168 samples where per_device_train_batch_size=2 trained 12" in told
    caplog.clear()
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=64)
    trainer = make_trainer(tmp_path, PadCollator())
    trainer.args.max_steps, trainer.args.num_train_epochs = -1, 2
    trainer.lr_scheduler = scheduler  # as Trainer(optimizers=(optimizer, scheduler)) holds it
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("autobatch")] == [
        "fit_batch_size: the learning-rate scheduler passed to the Trainer (OneCycleLR) was built before the size "
        "was set, for the steps at per_device_train_batch_size=2 (64); train() now runs 4 optimizer steps, so the "
        "schedule will not end where training ends; build it after fit_batch_size, for 4 steps (or pass "
        "lr_scheduler_type= and let train() build it)"]



def test_review36_a_checkpoint_period_that_no_longer_comes_before_the_end_is_one_warning(tmp_path, caplog, monkeypatch):
    """``save_steps=10`` saved at steps 10, 20, ... of the 64 at 2; at 28 the run has 4 steps and saved only at
    the end (measured: 64 samples, save_steps=10, 2 set to 26: only checkpoint-3), silently. A period the new
    count still reaches (2 of 4) is not warned about."""
    _, warnings, _ = _fit(tmp_path, caplog, monkeypatch, max_steps=-1, num_train_epochs=2, save_strategy="steps",
                          save_steps=10)
    assert warnings == [
        "fit_batch_size: save_steps=10 counted the 64 optimizer steps train() ran at per_device_train_batch_size=2; at "
        "28 it runs 4, so none comes before the end (no checkpoint or evaluation mid-run); give it as a share of the "
        "run (save_steps=0.16 keeps the cadence) or a count for 4 steps"]
    caplog.clear()
    assert _fit(tmp_path, caplog, monkeypatch, max_steps=-1, num_train_epochs=2, save_strategy="steps",
                save_steps=2)[1] == []


def test_review38_an_epoch_run_of_as_many_steps_does_not_say_samples_it_never_trains(tmp_path, caplog, monkeypatch):
    """By epochs, ``train()`` trains the set ``num_train_epochs`` times at any size; where the size set
    ran as many steps as the user's (64 samples: 22 and 28 a batch both run 3), the INFO line said
    ``84 samples where per_device_train_batch_size=22 trained 66``, the ``max_steps`` count, as if the
    run now trained 20 samples more than the set holds (measured: 100 samples, 16 x 4 set to 18 x 4,
    one epoch: ``144 samples where ... trained 128``)."""
    trainer, warnings, told = _fit(tmp_path, caplog, monkeypatch, max_steps=-1, num_train_epochs=1,
                                   dataloader_drop_last=False, per_device_train_batch_size=22)
    assert told.endswith("train() runs 3 optimizer step(s) (1 epoch(s)); pass global_batch= to keep a global batch")
    assert warnings == []
