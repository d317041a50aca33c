"""Review 22: a learning rate scaled with the batch size in ``configure_optimizers`` (the linear
scaling rule, ``lr = base_lr * self.hparams.batch_size / 256``). Lightning configures the
optimizers before ``on_fit_start``, where ``AutoBatchSize`` sets the size, so fit trained at the
callback's batch with the learning rate of the module's own (at 2 MiB: batch 506 at lr 0.00078
where the rule gives 0.198), silently. ``configure_optimizers`` now runs again where the
optimizers it makes at the size set differ in a hyperparameter."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402

from test_integration_lightning import BUDGET, Tiny  # noqa: E402


class Scaled(Tiny):
    """Adam at a learning rate in proportion to the batch size; ``fixed``: not."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed, self.lrs = fixed, []

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3 if self.fixed else 0.1 * self.hparams.batch_size / 256)

    def training_step(self, batch, index):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, index)


@pytest.mark.parametrize("fixed", [False, True])
def test_a_learning_rate_scaled_with_the_batch_is_configured_at_the_size_set(fixed, caplog):
    module, callback = Scaled(fixed), AutoBatchSize(memory_limit=BUDGET, confirm=False)
    with host_memory():
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with simulated_memory(BUDGET), caplog.at_level("INFO", logger="autobatch"):
        trainer.fit(module)
    size = callback.batch_size
    assert size > 100 and module.seen[-2:] == [size] * 2
    assert module.lrs[-2:] == [1e-3 if fixed else 0.1 * size / 256] * 2  # it was 0.1 * 2 / 256
    assert ("gives other lr at batch_size=" in caplog.text) != fixed  # the optimizers re-made only where they differ
