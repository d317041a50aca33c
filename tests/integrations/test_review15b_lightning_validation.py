"""Review 15b: ``AutoBatchSize``'s confirmation when the validation batch needs more memory a
sample than the training step (a ``validation_step`` that generates, a val loader at a multiple of
the batch).

* A run that ran out of memory in its validation batch left the trainer's stage at VALIDATING
  and the module in eval mode. Where such a run was the confirmation's last, ``fit``'s
  ``_run_stage`` saw an evaluating trainer and ran only the validation loop: ``fit`` returned
  having trained no step, with no error.
* A run whose validation needed far more than the probed step (16 MiB at 64 under 4 MiB) was read
  as a constant extra no size fits beside, and the callback raised ``MemoryError`` ("no batch size
  trained") where 15 trains and validates: the next size now scales by what the run needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.trainer.states import RunningStage  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402


class HeavyValidation(pl.LightningModule):
    """Training needs little; a validation batch 256 KiB a sample (16 or more fail under 4 MiB).
    It records whether its dropout trained in each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 1))
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator),
                                                   torch.randn(64, 1, generator=generator))
        self.dropout_trained: list[bool] = []

    def training_step(self, batch, index):
        self.dropout_trained.append(self.net[1].training)
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, index):
        torch.zeros(batch[0].shape[0], 64 * 1024)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


def test_fit_trains_after_a_run_that_ran_out_of_memory_while_validating():
    with host_memory():
        module, callback = HeavyValidation(), AutoBatchSize(memory_limit="4MiB")
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             callbacks=[callback])
    with simulated_memory("4MiB"):
        trainer.fit(module)
    runs = callback.confirmation.runs
    assert callback.batch_size == 15 and runs[0].batch_size == 64 and not runs[0].passed
    assert not runs[-1].passed  # the last run failed while validating: what left the trainer evaluating
    assert trainer.global_step == 2 and module.dropout_trained == [True, True]
