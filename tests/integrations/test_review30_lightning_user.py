"""Review 30: a Lightning user's next steps with ``AutoBatchSize``.

``fit`` called a second time on the same trainer (raising ``max_epochs``/``max_steps`` to train
on) probes again, and the confirmation's run was capped at ``max_steps=confirm_steps`` counted
from zero: the trainer's ``global_step`` was already past it, so the run took no optimizer step,
the probe's unconfirmed answer was set (803 where the first fit had confirmed 795, so the second
fit trained at another size than the first) and one warning said "fit may train nothing there;
set max_batch". The run's steps now count from the trainer's ``global_step``.

A train dataloader passed to ``fit()`` with no batch attribute anywhere got "no field
'batch_size'": the user added one, and only then learnt that a loader passed to ``fit()`` is
refused anyway. The loader is named first, with the field to build it from.

``fit`` called again with nothing left to train (``max_epochs`` or ``max_steps`` reached, as a
notebook cell run twice does) probed anyway, took no confirmation step, replaced the size the first
fit confirmed (795) with the probe's unconfirmed 803 and warned "fit may train nothing there; set
max_batch". It is not probed now: one INFO line, the size kept."""

from __future__ import annotations

import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, Tiny, trainer  # noqa: E402


def _two_step_run():
    """A module, its callback and a trainer whose first fit takes two steps (a size confirmed in one)."""
    module, callback = Tiny(), AutoBatchSize(memory_limit=BUDGET, max_batch=64, confirm_steps=1)
    run = trainer(callback)
    run.fit_loop.epoch_loop.max_steps = 2
    return module, callback, run


def test_a_second_fit_on_the_same_trainer_confirms_its_size_in_the_loop():
    module, callback, run = _two_step_run()
    with simulated_memory(BUDGET):
        run.fit(module)
        assert run.global_step == 2 and callback.confirmation.skipped is None
        run.fit_loop.epoch_loop.max_steps = 4  # train on, on the same trainer
        run.fit(module)  # its run took no step at global_step 2 >= 1: "not confirmed" before
    confirmation = callback.confirmation
    assert confirmation.skipped is None and confirmation.runs and confirmation.runs[-1].steps == 1
    assert run.global_step == 4 and module.hparams.batch_size == callback.batch_size == confirmation.batch_size


class Fieldless(Tiny):
    """A module whose size lives in no field: its loader is built outside and passed to fit."""

    def __init__(self) -> None:
        super().__init__()
        del self.hparams["batch_size"]


def test_a_loader_passed_to_fit_is_named_before_the_missing_field():
    module = Fieldless()
    loader = torch.utils.data.DataLoader(module.data, batch_size=7)
    with pytest.raises(ValueError, match=r"dataloaders passed to fit\(\) directly.*train_dataloader\(\) from 'batch_size'"):
        trainer(AutoBatchSize()).fit(module, train_dataloaders=loader)  # AttributeError "no field" before


def test_a_fit_with_nothing_left_to_train_is_not_probed_and_keeps_the_size():
    module, callback, run = _two_step_run()
    with simulated_memory(BUDGET):
        run.fit(module)
        size, seen = callback.batch_size, len(module.seen)
        module.hparams.batch_size = 3  # what fit trains at from here: the callback does not change it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.fit(module)  # max_steps=2 reached: Lightning trains nothing
    assert not [w for w in caught if "AutoBatchSize" in str(w.message)]  # "not confirmed ... set max_batch" before
    assert callback.result is None and callback.batch_size == size and module.hparams.batch_size == 3
    assert len(module.seen) == seen and run.global_step == 2


def test_review31_a_second_fit_carries_the_growth_over_the_steps_left_only():
    """The confirmation carries what the loop keeps batch after batch to the end of what fit runs;
    a second fit (3 steps taken, ``max_steps`` raised to 10) counted 10 steps to run, not the 7 left."""
    from test_integration_lightning import KeepsOutputs

    module, callback = KeepsOutputs(), AutoBatchSize(memory_limit=BUDGET, max_batch=64, confirm=False)
    run = trainer(callback)
    run.fit_loop.epoch_loop.max_steps = 3
    with simulated_memory(BUDGET):
        run.fit(module)  # unconfirmed: quicker
        run.fit_loop.epoch_loop.max_steps, callback.confirm, callback.confirm_steps = 10, True, 3
        run.fit(module)
    (grown,) = [loop for loop in callback.confirmation.runs if loop.growth_bytes]
    assert run.global_step == 10 and grown.epoch_batches == 7  # 64 batches an epoch at 64, 7 steps of 1 left



class _Cycle:
    """A reference cycle, as a Trainer is: only a collection frees it."""


def test_review36_the_probe_does_not_count_an_earlier_fits_garbage():
    """A sweep in one process (a new module, callback and Trainer a trial) probed its second trial beside
    the first one's weights, gradients and Adam state, garbage in the Trainer's reference cycles:
    NoBatchFitsError at batch 1 under 2 MiB, where each trial trains 304. Here 1 MiB of such garbage,
    with no automatic collection (which runs when the interpreter chooses)."""
    import gc

    module = Tiny()
    callback = AutoBatchSize(confirm=False, max_batch=300, steps_per_trial=1, probe_options={"start": 300})
    run = trainer(callback)
    run.fit_loop.epoch_loop.max_steps = 1
    gc.disable()
    try:
        with simulated_memory(BUDGET):
            garbage = _Cycle()
            garbage.me, garbage.held = garbage, torch.zeros(256 * 1024)
            gc.collect(1)  # old, as an earlier trial's Trainer is: a failed trial's quick collection leaves it
            del garbage
            run.fit(module)
    finally:
        gc.enable()
    assert callback.result.batch_size == 300 and module.seen[-1] == 300  # 300 fits beside nothing else
