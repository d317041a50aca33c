"""Review 26: a Lightning user who reads ``self.hparams.batch_size`` writes
``AutoBatchSize(batch_arg_name="hparams.batch_size")``. It was refused with a ``TypeError`` that
did not say what to write instead; it is now one ``ValueError`` naming the field alone, which is
looked up (and set) in the module's and the datamodule's ``hparams`` too, so the size lands where
``train_dataloader`` reads it and in the checkpoint's hyperparameters."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, SAMPLES, Tiny, trainer  # noqa: E402


@pytest.mark.parametrize("name", ["hparams.batch_size", "datamodule.hparams.batch_size"])
def test_a_path_as_batch_arg_name_is_one_error_naming_the_field(name):
    with pytest.raises(ValueError, match=r"is a path; name the field alone, batch_arg_name='batch_size'"):
        AutoBatchSize(batch_arg_name=name)


class Data(pl.LightningDataModule):
    """Keeps the batch size in its saved hyperparameters only, as ``save_hyperparameters()`` does."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator),
                                                   torch.randn(SAMPLES, 1, generator=generator))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, drop_last=True)


class Model(Tiny):
    def __init__(self) -> None:
        super().__init__()
        del self.hparams["batch_size"]

    train_dataloader = None


def test_the_field_alone_sets_the_datamodules_hparams_and_the_checkpoint_keeps_them(tmp_path):
    data, module, callback = Data(), Model(), AutoBatchSize(memory_limit=BUDGET, max_batch=64)
    run = trainer(callback)
    with simulated_memory(BUDGET):
        run.fit(module, datamodule=data)
    run.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert data.hparams.batch_size == callback.batch_size == module.seen[-1] > 2
    assert saved["datamodule_hyper_parameters"]["batch_size"] == callback.batch_size


class Config:
    batch_size = 2


class Nested(Tiny):
    """Keeps the batch size in a nested config, reached by the property the error names."""

    def __init__(self) -> None:
        super().__init__()
        del self.hparams["batch_size"]
        self.cfg = Config()

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.cfg.batch_size = value

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.cfg.batch_size, drop_last=True)


def test_review33_a_nested_config_path_names_the_property_that_reaches_it():
    # it said "name the field alone, batch_arg_name='batch_size'", which then failed at fit start
    with pytest.raises(ValueError, match=r"names a field of 'cfg', which is not looked up.*a property 'batch_size' "
                                         r"with a setter that reads and writes cfg.batch_size"):
        AutoBatchSize(batch_arg_name="cfg.batch_size")
    module, callback = Nested(), AutoBatchSize(memory_limit=BUDGET, max_batch=64)  # what the message says to do
    with simulated_memory(BUDGET):
        trainer(callback).fit(module)
    assert module.cfg.batch_size == callback.batch_size == module.seen[-1] == 64
