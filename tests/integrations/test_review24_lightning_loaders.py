"""Review 24: a LightningDataModule that builds its train DataLoader in ``setup()`` and returns it
from ``train_dataloader()`` (a common pattern) ignores the size ``AutoBatchSize`` sets: ``fit``
trained at the datamodule's own 2 while the callback logged 374, silently. It is now one
``ValueError`` before the first training step, naming the fix; a datamodule that builds the
loader in ``train_dataloader()`` trains at the size set."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, SAMPLES, Tiny, trainer  # noqa: E402


class Data(pl.LightningDataModule):
    def __init__(self, in_setup: bool) -> None:
        super().__init__()
        self.batch_size, self.in_setup = 2, in_setup
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator),
                                                   torch.randn(SAMPLES, 1, generator=generator))

    def setup(self, stage: str) -> None:
        if self.in_setup:
            self.loader = torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, drop_last=True)

    def train_dataloader(self):
        if self.in_setup:
            return self.loader
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, drop_last=True)


class Model(Tiny):
    """The batch size lives in the datamodule only."""

    def __init__(self) -> None:
        super().__init__()
        del self.hparams["batch_size"]

    train_dataloader = None


@pytest.mark.parametrize("in_setup", [True, False])
def test_a_datamodule_loader_built_in_setup_is_one_error_not_a_silent_run_at_its_own_size(in_setup):
    module, data, callback = Model(), Data(in_setup), AutoBatchSize(memory_limit=BUDGET, confirm=False, max_batch=32)
    fit = trainer(callback)
    with simulated_memory(BUDGET):
        if in_setup:
            with pytest.raises(ValueError, match=r"still batches at 2, as before.*inside train_dataloader\(\) from self.batch_size"):
                fit.fit(module, datamodule=data)
            assert module.seen == []  # no step trained at the wrong size
        else:
            fit.fit(module, datamodule=data)
    if not in_setup:
        assert callback.batch_size > 2 and data.batch_size == callback.batch_size
        assert module.seen == [callback.batch_size] * 4


class Fixed(Tiny):
    """``self.batch_size`` exists (BatchSizeFinder finds it), but the loader hard-codes 64."""

    def __init__(self) -> None:
        super().__init__()
        del self.hparams["batch_size"]
        self.batch_size = 2

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=64)


def test_a_loader_that_does_not_read_the_batch_attribute_is_one_error():
    module = Fixed()
    with simulated_memory(BUDGET), pytest.raises(ValueError, match=r"batch_size=\d+ \(it was 2\).*still batches at 64"):
        trainer(AutoBatchSize(memory_limit=BUDGET, confirm=False, max_batch=32)).fit(module)
    assert module.seen == []


class ReadOnly(Tiny):
    """``batch_size`` as a read-only view of ``hparams`` (BatchSizeFinder's ``lightning_setattr``
    cannot write it either)."""

    @property
    def batch_size(self) -> int:
        return self.hparams.batch_size


def test_a_read_only_batch_size_property_is_one_error_before_the_probe():
    callback = AutoBatchSize(memory_limit=BUDGET)
    with simulated_memory(BUDGET) as device, pytest.raises(AttributeError, match=r"ReadOnly.batch_size is a property "
                                                                                 r"without a setter: add one"):
        trainer(callback).fit(ReadOnly())
    assert callback.result is None and device.oom_count == 0  # refused before any trial (they ran, then it failed)


class Shuffled(Tiny):
    """A OneCycleLR sized from ``estimated_stepping_batches`` (Lightning builds the train loader and
    its iterator in ``configure_optimizers`` then) and a shuffled train loader; keeps its batches."""

    def training_step(self, batch, index):
        self.batches = getattr(self, "batches", []) + [batch[0].sum().item()]
        return super().training_step(batch, index)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, shuffle=True)


def test_review38_fit_shuffles_as_fit_without_the_callback_at_the_size_set():
    """The callback drops the loader Lightning built before on_fit_start (its iterator had drawn a
    seed), and fit drew that seed again: the same seed trained other batches than fit at the size."""
    runs = []
    for callbacks, size in (([AutoBatchSize(max_batch=16, confirm=False)], 2), ([], 16)):
        torch.manual_seed(5)
        module = Shuffled(batch_size=size)
        fit = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        with simulated_memory(BUDGET):
            fit.fit(module)  # max_epochs: estimated_stepping_batches builds the loader (under max_steps it does not)
        runs.append(module.batches)
    assert runs[0] == runs[1]
