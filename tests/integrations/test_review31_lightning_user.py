"""Review 31: a Lightning user's settings beside ``AutoBatchSize``.

A fractional ``Trainer(limit_val_batches=0.1)`` with a val dataloader built from the batch
attribute: at the module's own size (2) the val loader had 128 batches, and 0.1 of them held; at
the probed size it had 1, and ``fit`` failed in its sanity check, after the probe and the
confirmation, with Lightning's "You requested to check 0.1 of the `val_dataloader` but 0.1 * 1 < 1",
naming neither the callback nor its size. Now one ``ValueError`` before training names the size,
the val batches and what to change (``lightning_epochs.check_val_limit``).

The confirmation's run ends at its own ``max_steps``, and Lightning printed "`Trainer.fit` stopped:
`max_steps=3` reached." before ``fit`` trained, as if the user's ``fit`` had stopped at a limit
they never set; that line is muted during the run (``lightning_loop_state.quiet_stop``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, Tiny, trainer  # noqa: E402


class Validates(Tiny):
    """Validates on a loader at twice the batch attribute (no gradients to keep)."""

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=2 * self.hparams.batch_size)


def test_review31_a_fractional_limit_val_batches_that_leaves_no_val_batch_is_one_error_before_training():
    module, callback = Validates(), AutoBatchSize(memory_limit=BUDGET, max_batch=256, confirm=False)
    with simulated_memory(BUDGET), pytest.raises(ValueError, match=(
            r"at batch size 256 the val dataloader has 1 batch\(es\), and Trainer\(limit_val_batches=0.1\) validates "
            r"int\(1 x 0.1\) = 0 .*limit_val_batches at least 1.0, an integer limit_val_batches.*max_batch=N.* "
            r"10 val batches")):
        trainer(callback, limit_val_batches=0.1).fit(module)
    assert module.seen == []  # before any step (Lightning's error came in the sanity check, after the probe)
    run = trainer(AutoBatchSize(memory_limit=BUDGET, max_batch=32, confirm=False), limit_val_batches=0.25)
    with simulated_memory(BUDGET):
        run.fit(module)  # 8 val batches of 64 at 32: 0.25 of them validate, as Lightning counts
    assert run.num_val_batches == [2] and module.seen[-4:] == [32] * 4


def test_review31_the_confirmation_run_does_not_print_that_fit_stopped():
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where Lightning's rank_zero_info writes
    logger.addHandler(handler)
    try:
        with simulated_memory(BUDGET):
            trainer(AutoBatchSize(memory_limit=BUDGET, max_batch=16, confirm_steps=1)).fit(Tiny())
    finally:
        logger.removeHandler(handler)
    assert [line for line in said if "stopped" in line] == ["`Trainer.fit` stopped: `max_steps=4` reached."]
