"""Review 30b: a Lightning run resumed with ``fit(ckpt_path=...)`` from a checkpoint of
``AutoBatchSize(global_batch=64)`` (trained 32 x 2) that does not train what its script says.

A new ``Trainer(accumulate_grad_batches=8)`` got the checkpoint's 32 x 2, with only an INFO
"restored" line: the user's 8 was dropped silently. It is now one warning naming both, why
(the checkpoint's split keeps the samples per step and the batch size) and how to split anew.

The same checkpoint resumed with ``AutoBatchSize()`` (``global_batch`` dropped) probed again and
trained 32 x 1: the samples per optimizer step fell from 64 to 32 mid-run, with only an INFO line
saying it probes again. It is now one warning naming both counts and ``global_batch=64``."""

from __future__ import annotations

import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, Tiny, trainer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of a run that ``AutoBatchSize(global_batch=64)`` split into 32 x 2."""
    path = tmp_path_factory.mktemp("review30b") / "run.ckpt"
    callback = AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False, global_batch=64)
    first = trainer(callback)
    first.fit_loop.epoch_loop.max_steps = 1
    with simulated_memory(BUDGET):
        first.fit(Tiny())
    assert (callback.batch_size, callback.accumulation) == (32, 2)
    first.save_checkpoint(path)
    return path


def resumed(path, callback, **options):
    """Resume ``fit`` from ``path`` for one more optimizer step; the module and the callback's warnings."""
    module, run = Tiny(), trainer(callback, **options)
    run.fit_loop.epoch_loop.max_steps = 2
    with simulated_memory(BUDGET), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(module, ckpt_path=path)
    return module, run, [str(w.message) for w in caught if "AutoBatchSize" in str(w.message)]


def test_a_new_trainers_accumulation_replaced_by_the_checkpoints_is_warned(checkpoint):
    callback = AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False, global_batch=64)
    module, run, said = resumed(checkpoint, callback, accumulate_grad_batches=8)
    assert run.accumulate_grad_batches == 2 and module.seen == [32, 32]  # the checkpoint's split trains
    assert len(said) == 1  # only an INFO "restored" line before
    assert "accumulate_grad_batches=8 (set on the Trainer)" in said[0] and "checkpoint's accumulate_grad_batches=2" in said[0]
    assert f"del checkpoint['callbacks'][{callback.state_key!r}]" in said[0]


def test_a_resume_without_the_checkpoints_global_batch_warns_that_samples_per_step_change(checkpoint):
    callback = AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False)
    module, run, said = resumed(checkpoint, callback)
    assert callback.batch_size == 32 and run.accumulate_grad_batches == 1 and module.seen == [32]
    assert len(said) == 1  # only an INFO "probing again" line before
    assert "trained 64 samples per optimizer step" in said[0] and "this run trains 32 (32 x" in said[0]
    assert "AutoBatchSize(global_batch=64)" in said[0]


def test_review31_a_max_batch_lowered_on_resume_holds_keeping_the_global_batch(checkpoint):
    """The checkpoint's 32 x 2 won over ``max_batch=16`` (only an INFO "restored" line): the cap
    now holds, the checkpoint's 64 samples per optimizer step kept as 16 x 4, in one warning."""
    callback = AutoBatchSize(memory_limit=BUDGET, max_batch=16, confirm=False, global_batch=64)
    module, run, said = resumed(checkpoint, callback)
    assert (callback.batch_size, callback.accumulation, run.accumulate_grad_batches) == (16, 4, 4)
    assert module.hparams.batch_size == 16 and set(module.seen) == {16}
    assert len(said) == 1 and "max_batch=16 is below the checkpoint's batch_size=32" in said[0]
    assert "16 x accumulate_grad_batches=4, the checkpoint's 64 samples per optimizer step (32 x 2)" in said[0]


def test_review31_a_late_restoring_strategy_warns_that_samples_per_step_change(checkpoint):
    """Under a strategy that restores callbacks after ``on_fit_start`` (``restore_checkpoint_after_setup``)
    the probe runs first and the checkpoint's state comes later: dropping its ``global_batch`` went unsaid."""
    from test_lightning_probe import LateRestore

    callback = AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False)
    module, run, said = resumed(checkpoint, callback, strategy=LateRestore(torch.device("cpu")))
    assert callback.batch_size == 32 and run.accumulate_grad_batches == 1 and module.seen == [32]
    assert len(said) == 1 and "trained 64 samples per optimizer step" in said[0]  # none before
    assert "this run trains 32 (32 x" in said[0] and "AutoBatchSize(global_batch=64)" in said[0]


def test_review31_without_global_batch_a_lowered_max_batch_keeps_the_samples_per_step(tmp_path):
    """A checkpoint of 32 x the Trainer's accumulate_grad_batches=2 (no ``global_batch``) resumed with
    ``max_batch=16``: 16 x 4 keeps its 64 samples a step, the Trainer's 2 replaced in one warning."""
    path, first = tmp_path / "plain.ckpt", trainer(AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False),
                                                   accumulate_grad_batches=2)
    first.fit_loop.epoch_loop.max_steps = 1
    with simulated_memory(BUDGET), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 2 x 2 became 32 x 2: said, and not what this test is about
        first.fit(Tiny())
    first.save_checkpoint(path)
    callback = AutoBatchSize(memory_limit=BUDGET, max_batch=16, confirm=False)
    module, run, said = resumed(path, callback, accumulate_grad_batches=2)
    assert (callback.batch_size, callback.accumulation, run.accumulate_grad_batches) == (16, 4, 4)
    assert len(said) == 1 and "16 x accumulate_grad_batches=4 (the Trainer's accumulate_grad_batches=2 replaced)" in said[0]
    assert "the checkpoint's 64 samples per optimizer step (32 x 2)" in said[0]
