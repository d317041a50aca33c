"""Review 21: ``AutoBatchSize`` with manual optimization that steps every other batch (manual
gradient accumulation). At the probed size an epoch had one batch (``drop_last``), so the
``training_step`` never reached an odd batch index and never stepped: the confirmation's loop run,
bounded only by ``max_steps``, looped over epochs forever. The run now stops after a few batches
without an optimizer step and one warning says fit may train nothing at that size. Also: the
probe's note for plain callables ("the trials trained the model for real ... pass restore=") is
not in the callback's result, whose state is put back."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402

from test_integration_lightning import BUDGET, Tiny  # noqa: E402


CALLS: list[int] = []  # training_step's batch sizes, outside the module (its attributes are put back)


class EveryOther(Tiny):
    """Manual optimization, the optimizer stepped after every second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, index):
        x, y = batch
        CALLS.append(x.shape[0])
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        if index % 2 == 1:
            self.optimizers().step()
            self.optimizers().zero_grad()


def test_a_loop_run_that_never_steps_the_optimizer_stops_and_is_said():
    with host_memory():
        module = EveryOther()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, max_epochs=24, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[callback := AutoBatchSize(memory_limit=BUDGET, max_batch=300)])
    with warnings.catch_warnings(record=True) as caught, simulated_memory(BUDGET):
        warnings.simplefilter("always")
        trainer.fit(module)  # looped forever in the confirmation before
    assert 24 <= CALLS.count(300) < 45  # fit: 24 epochs of one batch; the check run: 12 at most (it ran 24)
    assert callback.batch_size == 300 and "took no optimizer step at 300" in callback.confirmation.skipped
    assert any("fit may train nothing there" in str(w.message) for w in caught)
    assert not any("trained the model for real" in note for note in callback.result.notes)
    # drop_last at 300 of 512 samples: 212 left out of every epoch, where the module's own 2 left none
    assert any("leaves 212 of the 512 samples" in str(w.message) and "drop_last=False" in str(w.message) for w in caught)


class Critic(pl.LightningModule):
    """A WGAN's pattern: the critic steps every batch, the generator after every third."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
        self.critic = nn.Linear(8, 1)
        self.data = torch.utils.data.TensorDataset(torch.randn(4096, 8, generator=torch.Generator().manual_seed(1)))

    def training_step(self, batch, index):
        (x,), (opt_g, opt_c) = batch, self.optimizers()
        z = torch.randn(x.shape[0], 4)
        self.toggle_optimizer(opt_c)
        self.manual_backward(self.critic(self.gen(z).detach()).mean() - self.critic(x).mean())
        opt_c.step(), opt_c.zero_grad(), self.untoggle_optimizer(opt_c)
        if index % 3 == 2:
            self.toggle_optimizer(opt_g)
            self.manual_backward(-self.critic(self.gen(z)).mean())
            opt_g.step(), opt_g.zero_grad(), self.untoggle_optimizer(opt_g)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters()), torch.optim.Adam(self.critic.parameters())]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, drop_last=True)


def test_review33_the_loop_run_waits_for_each_optimizers_second_step():
    # the run ended after 3 critic steps: the generator's state was never measured, and under 1 MiB the
    # callback set a size (380, from a probe whose batch index 0 steps no generator) where fit ran out of
    # memory at the generator's second step (batch 5); the run now takes both optimizers' second steps
    callback = AutoBatchSize(memory_limit="8MiB", max_batch=64)
    run = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with simulated_memory("8MiB"):
        run.fit(Critic())
    assert [r.steps for r in callback.confirmation.runs] == [8] and not callback.confirmation.skipped  # 6 + 2


def test_review37_a_run_that_ends_with_fits_last_epoch_confirms_the_size():
    # an epoch of one batch at the size (64 samples) under max_epochs=1: the run ended where fit ends, each
    # optimizer stepped once as in fit, yet the size was left "not confirmed ... fit may run out of memory there;
    # set max_batch", for a second step fit never takes
    module, callback = Critic(), AutoBatchSize(memory_limit="8MiB", max_batch=64)
    module.data = torch.utils.data.TensorDataset(module.data.tensors[0][:64])
    run = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with simulated_memory("8MiB"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(module)
    assert callback.batch_size == 64 and [r.steps for r in callback.confirmation.runs] == [1]
    assert not callback.confirmation.skipped and not any("AutoBatchSize" in str(w.message) for w in caught)
