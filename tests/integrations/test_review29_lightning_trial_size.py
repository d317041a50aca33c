"""Review 29: a ``training_step`` that reads the batch attribute (a GAN's noise,
``torch.randn(self.hparams.batch_size, latent)``) got the module's own size in every probe trial,
where ``fit`` runs it at the size set: the probe ended ``fit`` with "The size of tensor a (8) must
match the size of tensor b (2)" (Lightning's ``BatchSizeFinder`` sets the attribute before each
trial). Each trial now runs with the attribute at its size, put back after it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.integrations.lightning_step import trial_size  # noqa: E402

from test_integration_lightning import BUDGET, Tiny, trainer  # noqa: E402

READ: list[tuple[int, int]] = []  # (the attribute, the batch's size) at each training_step: outside the module


class Noisy(Tiny):
    """Adds noise sized from ``self.hparams.batch_size``, as GAN examples draw their latent batch."""

    def training_step(self, batch, index):
        x, y = batch
        READ.append((self.hparams.batch_size, x.shape[0]))
        self.seen.append(x.shape[0])
        return nn.functional.mse_loss(self.net(x + torch.randn(self.hparams.batch_size, x.shape[1])), y)


def test_a_training_step_that_reads_the_batch_size_is_probed_at_each_trials_size():
    READ.clear()
    module, callback = Noisy(), AutoBatchSize(memory_limit=BUDGET, max_batch=64, confirm=False)
    with simulated_memory(BUDGET):
        trainer(callback).fit(module)  # RuntimeError "The size of tensor a (8) ..." from the probe before
    size = callback.batch_size
    assert size > 2 and module.hparams.batch_size == size and module.seen[-4:] == [size] * 4
    assert len(READ) > 4 and all(read == batch for read, batch in READ)  # every trial and fit step alike


def test_the_attribute_is_put_back_everywhere_after_a_trial_that_fails():
    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 3

    module, data = Tiny(batch_size=2), Data()
    run = trainer()
    run.strategy.connect(module)
    module.trainer = run
    run.datamodule = data
    with pytest.raises(torch.OutOfMemoryError), trial_size(module, "batch_size", 40):
        assert (module.hparams.batch_size, data.batch_size) == (40, 40)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    assert (module.hparams.batch_size, data.batch_size) == (2, 3)
