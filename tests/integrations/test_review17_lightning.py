"""Review 17: ``AutoBatchSize`` with a precision plugin whose ``GradScaler`` is disabled, and
with a fractional ``limit_train_batches``.

* ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler(enabled=False))`` (a plugin built with
  ``enabled=use_fp16``): the state reset after the probe cleared the scaler's per-optimizer
  marks, which a disabled scaler does not have, and ``fit`` ended with ``AttributeError: ...
  '_per_optimizer_states'``.
* ``limit_train_batches=0.5`` over 512 samples: the probe's 374 left an epoch one batch, of
  which Lightning trains ``int(1 * 0.5) == 0``, and ``fit`` failed after the callback ("0.5 * 1
  < 1"). The batch is now capped where every limited epoch trains a batch (256)."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402

from test_integration_lightning import BUDGET, Tiny  # noqa: E402


def fit(budget, callback, **options):
    with host_memory():
        module = Tiny()
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **options)
    with simulated_memory(budget):
        trainer.fit(module)
    return trainer, module


def test_a_disabled_grad_scaler_in_the_precision_plugin_trains():
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    callback = AutoBatchSize(memory_limit=BUDGET, confirm=False)
    trainer, module = fit(BUDGET, callback, max_steps=1, plugins=[plugin], gradient_clip_val=1.0)
    assert callback.batch_size > 2 and trainer.global_step == 1 and module.seen[-1] == callback.batch_size


@pytest.mark.parametrize("limit, size", [(0.5, 256), (0.1, 51)])
def test_a_fractional_limit_caps_the_batch_where_each_epoch_trains_one(limit, size):
    callback = AutoBatchSize(memory_limit=BUDGET, confirm=False)
    trainer, module = fit(BUDGET, callback, max_epochs=1, limit_train_batches=limit)
    assert callback.batch_size == size and callback.result.batch_size == size  # 374 unlimited
    assert trainer.global_step == int(512 // size * limit) >= 1 and module.seen[-1] == size


def test_a_limit_that_leaves_no_batch_is_one_error_naming_it():
    with pytest.raises(ValueError, match=r"limit_train_batches=0\.001 .*raise limit_train_batches"):
        fit(BUDGET, AutoBatchSize(memory_limit=BUDGET, confirm=False), max_epochs=1, limit_train_batches=0.001)


def test_an_overflowing_fp16_scale_does_not_skip_the_probes_optimizer_steps():
    """``init_scale=1e12``: every trial's scaled gradients overflowed, ``scaler.step`` skipped
    Adam's step, and the size was measured without Adam's moments (512 under 1400 KiB, where 303
    is what trains with them). The trials now run at scale 1; the scale is put back after them."""
    def answer(init_scale):
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
        callback = AutoBatchSize(memory_limit="1400KiB", confirm=False)
        fit("1400KiB", callback, max_steps=1, plugins=[plugin])
        assert plugin.scaler.get_scale() == pytest.approx(init_scale * (0.5 if init_scale > 1e6 else 1.0))  # fit's step only
        return callback.batch_size

    assert answer(1e12) == answer(1.0) < 512
