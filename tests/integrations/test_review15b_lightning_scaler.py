"""Review 15b: ``AutoBatchSize`` under ``"16-mixed"`` with a ``GradScaler`` and gradient clipping.
Lightning's precision plugin calls ``scaler.unscale_(optimizer)`` before
``on_before_optimizer_step``, the clipping and the optimizer step; a probe trial that ran out of
memory there left the optimizer marked unscaled, and the next trial's ``unscale_`` raised
"unscale_() has already been called on this optimizer since the last update()", ending ``fit``
inside the callback. Each trial now starts with the mark cleared (no step is under way then)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402


class Clipped(pl.LightningModule):
    """A tiny regression whose ``on_before_optimizer_step`` (run after the scaler's ``unscale_``)
    needs 256 KiB a sample: under 4 MiB, 16 samples or more run out of memory there."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.batch_size, self.automatic_optimization = 2, not manual
        torch.manual_seed(0)
        self.net = nn.Linear(16, 1)
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=generator),
                                                   torch.randn(256, 1, generator=generator))

    def training_step(self, batch, index):
        self.samples = batch[0].shape[0]
        loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0)
        optimizer.step()
        return None

    def on_before_optimizer_step(self, optimizer):
        torch.zeros(self.samples, 64 * 1024)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


@pytest.mark.parametrize("manual", [False, True])
def test_a_trial_that_ran_out_of_memory_after_unscale_does_not_end_the_probe(manual):
    with host_memory():
        module, callback = Clipped(manual), AutoBatchSize(memory_limit="4MiB", confirm=False)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, gradient_clip_val=None if manual else 1.0, callbacks=[callback],
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    with simulated_memory("4MiB"):
        trainer.fit(module)
    assert 8 <= callback.batch_size < 16 and any(not trial.passed for trial in callback.result.trials)
    assert module.batch_size == callback.batch_size and trainer.global_step == 1
