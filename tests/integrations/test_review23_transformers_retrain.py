"""Review 23: ``fit_batch_size`` between two ``Trainer.train()`` calls (a sweep, or a second stage on
new data). After a first ``train()`` the trainer holds the scheduler ``train()`` built itself
(``trainer._created_lr_scheduler``), which the next ``train()`` drops and rebuilds for its own step
count. ``fit_batch_size`` took it for one passed in with ``Trainer(optimizers=(optimizer,
scheduler))`` and warned that it "was built before the size was set", advising to build it after
``fit_batch_size``: a false alarm with advice the user cannot follow. One passed in still warns
(``test_review20b_transformers_schedule.py``). The probe is stubbed to a fixed answer, 28."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402
from test_review19_samples_per_step import _answer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def test_a_scheduler_train_built_itself_is_no_warning_before_the_next_train(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(28))
    trainer = make_trainer(tmp_path, PadCollator())  # max_steps=2 at per_device_train_batch_size=2
    trainer.create_optimizer_and_scheduler(num_training_steps=2)  # as the first train() (max_steps=2) does
    assert trainer.lr_scheduler is not None and trainer._created_lr_scheduler  # the next train() rebuilds it
    trainer.args.max_steps, trainer.args.num_train_epochs = -1, 2  # the second stage: 64 steps at 2, 4 at 28
    with caplog.at_level(logging.INFO, logger="autobatch"):
        fit_batch_size(trainer)
    ours = [r.getMessage() for r in caplog.records if r.name == "autobatch"]
    assert any("train() runs 4 optimizer step(s) (2 epoch(s)) where per_device_train_batch_size=2 ran 64" in m
               for m in ours)  # the step count did change
    assert not [m for m in ours if "learning-rate scheduler" in m]
