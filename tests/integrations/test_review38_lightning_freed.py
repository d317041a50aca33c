"""``AutoBatchSize`` does not keep the ``Trainer`` alive (review 38). It held the trainer whose
``accumulate_grad_batches`` it noted (to know the user's value from its own on a later fit), so a
callback kept to read ``batch_size`` kept the trainer, and through it the module, after the user
dropped both. Lightning itself also attaches the module's ``log`` to every callback (its own
reference, left alone)."""

from __future__ import annotations

import weakref

import pytest

pytest.importorskip("lightning.pytorch")

from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402


def test_review38_the_lightning_callback_does_not_keep_the_trainer():
    class Trainer:
        accumulate_grad_batches = 3

    finder, trainer = AutoBatchSize(), Trainer()
    finder._given_accumulation(trainer)
    trainer.accumulate_grad_batches = finder.accumulation = 5  # the callback's own, on a later fit
    finder._given_accumulation(trainer)
    assert finder._given[1] == 3  # the user's value, noted first, is kept for the same trainer
    held = weakref.ref(trainer)
    del trainer
    assert held() is None
