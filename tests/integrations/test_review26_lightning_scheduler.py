"""Review 26: with no ``global_batch``, a ``GradientAccumulationScheduler`` beside ``AutoBatchSize``
sets ``accumulate_grad_batches`` at each epoch's start, after the callback ran, so the warning the
Trainer's own ``accumulate_grad_batches`` gets (the samples per step changed; a window that no
longer divides the epoch) was never given: a module batch of 2 with ``{0: 2, 1: 4}`` on 512
samples (``drop_last``) became 374, one batch an epoch, and every step trained it at half (then a
quarter) of its mean gradient, silently. It is now one warning naming the schedule and a fix."""

from __future__ import annotations

import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, Tiny  # noqa: E402


def _fit(schedule, own=2, **options):
    module, callback = Tiny(batch_size=own), AutoBatchSize(memory_limit=BUDGET, confirm=False, **options)
    run = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[callback, GradientAccumulationScheduler(schedule)])
    with simulated_memory(BUDGET), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(module)
    said = [str(w.message) for w in caught if "GradientAccumulationScheduler's" in str(w.message)]
    return callback, module, said


def test_a_schedule_the_new_size_changes_is_one_warning_naming_it_and_a_max_batch():
    callback, module, said = _fit({0: 2, 1: 4})
    assert callback.batch_size > 2 and set(module.seen) == {callback.batch_size}
    assert len(said) == 1, said
    size = callback.batch_size
    assert size > 256  # one batch an epoch of 512 (drop_last): each step trains it, whatever the window
    assert "(2 from epoch 0, 4 from epoch 1)" in said[0]
    assert f"trains {size} / {size} samples per optimizer step where batch_size=2 trained 4 / 8" in said[0]
    assert "has 1 batch(es), which accumulate_grad_batches=2 or 4 does not divide" in said[0]
    assert "max_batch=128 (4 batches an epoch, a multiple of 4)" in said[0]


def test_a_schedule_is_not_warned_where_the_size_is_the_modules_own():
    callback, _, said = _fit({0: 2}, own=128, max_batch=128)
    assert callback.batch_size == 128 and said == []
