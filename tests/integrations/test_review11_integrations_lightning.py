"""Review 11: AutoBatchSize as a Lightning user switching from ``Tuner.scale_batch_size`` uses it."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

SAMPLES = 64


class Plateau(pl.LightningModule):
    """A module whose learning rate follows ``val_loss`` (``ReduceLROnPlateau``, the scheduler's
    default epoch interval): Lightning steps it at each epoch's end with the metric its
    validation logged there."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator),
                                                   torch.randn(SAMPLES, 1, generator=generator))
        self.seen: list[int] = []

    def training_step(self, batch, index):
        self.seen.append(batch[0].shape[0])
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, index):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size)


def test_the_confirmation_validates_at_an_epoch_end_for_a_plateau_scheduler():
    """The answer is the whole train set (one batch an epoch), so the confirmation's 3 steps
    cross epoch ends: where it validated only after its last step, Lightning's epoch-end
    ``ReduceLROnPlateau`` update found no ``val_loss`` and ``fit`` failed inside the callback
    (``MisconfigurationException: ReduceLROnPlateau conditioned on metric val_loss which is not
    available``), where ``fit`` without it validates at each epoch's end and trains."""
    module, finder = Plateau(), AutoBatchSize()
    with simulated_memory("8MiB"):
        fit = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[finder])
        fit.fit(module)
    assert finder.batch_size == SAMPLES and finder.confirmation.runs[-1].passed
    assert finder.confirmation.runs[-1].validated
    assert module.seen[-2:] == [SAMPLES, SAMPLES] and fit.global_step == 2  # fit's two epochs, at the answer
    assert fit.lr_scheduler_configs[0].scheduler.last_epoch == 2  # stepped by fit's epochs, not the confirmation's


def test_a_missing_lightning_is_one_import_error_saying_what_to_install(monkeypatch):
    """``import autobatch`` needs no framework; the Lightning integration's import says what to
    install, where it said only "No module named 'lightning'"."""
    for name in [n for n in sys.modules if n == "autobatch.integrations.lightning" or n.startswith("lightning")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install lightning \(from the checkout: pip install -e '\.\[lightning\]'\)"):
        import autobatch.integrations.lightning  # noqa: F401


def test_a_batch_size_finder_beside_it_is_refused_before_either_searches(tmp_path):
    """Lightning runs tuner callbacks first: a ``BatchSizeFinder`` left in the callbacks spent its
    trials (and wrote its checkpoint file), then AutoBatchSize replaced its answer. One error at
    setup, before any trial or file."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    module = Plateau()
    fit = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                     callbacks=[AutoBatchSize(), BatchSizeFinder(max_trials=2)])
    with pytest.raises(ValueError, match="remove the BatchSizeFinder"):
        fit.fit(module)
    assert module.seen == [] and list(tmp_path.iterdir()) == []
