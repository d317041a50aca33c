"""Review 20: ``AutoBatchSize`` with several train dataloaders that batch at different multiples
of the batch size (semi-supervised: a labeled loader at ``batch_size``, an unlabeled one at
``3 * batch_size``). The probe resized the combined batch as one and refused it ("the batch's
tensors must share dim 0 (the batch); got sizes [2, 6]"); each loader's part is now resized in
proportion, so the answer is the largest that trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402

from test_integration_lightning import BUDGET, Tiny  # noqa: E402


class SemiSupervised(Tiny):
    """A labeled loader at the batch size, an unlabeled one at three times it."""

    def train_dataloader(self):
        labeled = torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, drop_last=True)
        unlabeled = torch.utils.data.DataLoader(self.data, batch_size=3 * self.hparams.batch_size, drop_last=True)
        return {"labeled": labeled, "unlabeled": unlabeled}

    def training_step(self, batch, index):
        (x, y), (u, _) = batch["labeled"], batch["unlabeled"]
        self.seen.append((x.shape[0], u.shape[0]))
        return nn.functional.mse_loss(self.net(x), y) + self.net(u).pow(2).mean()


def _fit(module, *callbacks):
    with host_memory():
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    with simulated_memory(BUDGET):
        trainer.fit(module)


def test_loaders_at_different_multiples_of_the_batch_are_probed_each_at_its_own():
    with host_memory():
        module = SemiSupervised()
    callback = AutoBatchSize(memory_limit=BUDGET, confirm=False)
    _fit(module, callback)
    size = callback.batch_size
    assert 50 < size < 170 and module.seen[-2:] == [(size, 3 * size)] * 2  # fit trained both at the answer
    with pytest.raises(torch.OutOfMemoryError):  # and 2 % more does not (the trials were the loop's batches)
        _fit(SemiSupervised(batch_size=size + 2))
