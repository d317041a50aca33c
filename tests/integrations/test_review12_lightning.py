"""Review 12: AutoBatchSize with an integer ``val_check_interval``, and a batch size that lives only
in a datamodule's ``hparams``.

An integer ``val_check_interval`` counts training batches within an epoch, and Lightning refuses
one above the epoch's batches (unless ``check_val_every_n_epoch=None``). A larger batch shortens
the epoch: ``Trainer(val_check_interval=50)`` with 512 samples held at the module's batch of 2
(256 batches) and failed at the callback's 512 (1 batch) with Lightning's own ``ValueError``,
raised from inside the callback's confirmation run (and, with ``confirm=False``, from ``fit``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.utilities.parsing import lightning_getattr  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402

SAMPLES, INTERVAL = 512, 50


def _data(seed: int = 1) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator),
                                          torch.randn(SAMPLES, 1, generator=generator))


class Validated(pl.LightningModule):
    """A small regression module whose loaders follow ``batch_size``; it records the steps at
    which ``fit`` validated."""

    def __init__(self, batch_size: int = 2, width: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
        self.data = _data()
        self.seen: list[int] = []
        self.validated_at: list[int] = []

    def training_step(self, batch, index):
        self.seen.append(batch[0].shape[0])
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, index):
        if index == 0 and not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.global_step)
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


def trainer(*callbacks, **options):
    settings = dict(accelerator="cpu", devices=1, max_steps=60, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(callbacks=list(callbacks), **{**settings, **options})


@pytest.mark.parametrize("confirm", [True, False])
def test_an_interval_longer_than_the_epoch_at_the_size_is_one_error_naming_what_to_change(confirm):
    """The reproduction: 64 MiB fits the whole dataset (one batch an epoch), 50 batches were asked
    for. Lightning's error came from the confirmation's loop run (or from fit); now the run works
    and one error, before any training step of fit, names the size and the settings."""
    module, finder = Validated(), AutoBatchSize(confirm=confirm)
    with simulated_memory("64MiB"), pytest.raises(ValueError) as caught:
        trainer(finder, val_check_interval=INTERVAL).fit(module)
    message = str(caught.value)
    assert message.startswith(f"AutoBatchSize: at batch size {SAMPLES} an epoch has 1 training batch(es)")
    assert "val_check_interval=50" in message and "check_val_every_n_epoch=None" in message
    assert "AutoBatchSize(max_batch=10)" in message and "limit_val_batches=0" in message
    assert module.validated_at == []  # fit never trained
    if confirm:  # the check run itself ran, and validated (at its epoch's end), where it raised
        assert finder.confirmation.runs[-1].passed and finder.confirmation.runs[-1].validated
    assert module.batch_size == SAMPLES


@pytest.mark.parametrize("multiple_of, cap", [(1, 10), (8, 8)])
def test_the_suggested_max_batch_trains_and_validates_every_interval(multiple_of, cap):
    """The suggested cap leaves epochs of at least 50 batches (a multiple of ``multiple_of``)."""
    with simulated_memory("64MiB"), pytest.raises(ValueError, match=rf"AutoBatchSize\(max_batch={cap}\)"):
        trainer(AutoBatchSize(multiple_of=multiple_of), val_check_interval=INTERVAL).fit(Validated())
    module, finder = Validated(), AutoBatchSize(max_batch=cap, multiple_of=multiple_of)
    with simulated_memory("64MiB"):
        trainer(finder, val_check_interval=INTERVAL).fit(module)
    assert finder.batch_size == cap and module.seen[-1] == cap and module.validated_at == [INTERVAL]


def test_check_val_every_n_epoch_none_trains_at_the_size_and_validates_across_epochs():
    """With ``check_val_every_n_epoch=None`` Lightning accepts the interval (counted over epochs):
    no error, the whole dataset per batch, validation at steps 50 and 100, as asked."""
    module, finder = Validated(), AutoBatchSize()
    with simulated_memory("64MiB"):
        fit = trainer(finder, max_steps=120, val_check_interval=INTERVAL, check_val_every_n_epoch=None)
        fit.fit(module)
    assert finder.batch_size == SAMPLES and fit.global_step == 120
    assert module.validated_at == [INTERVAL, 2 * INTERVAL]


def test_an_interval_the_epoch_allows_is_kept_as_lightning_keeps_it():
    """At batch 200 an epoch has 3 batches (200, 200, 112): an interval of 3 validates at each
    epoch's last batch; the check run and the final count leave fit's schedule alone."""
    module, finder = Validated(), AutoBatchSize(max_batch=200)
    with simulated_memory("64MiB"):
        trainer(finder, max_steps=12, val_check_interval=3).fit(module)
    assert finder.batch_size == 200 and module.validated_at == [3, 6, 9, 12]


class Capture(pl.Callback):
    """The module's weights and the random state where this callback's ``on_fit_start`` runs."""

    def on_fit_start(self, trainer, module):
        with host_memory():
            self.weights = {k: v.clone() for k, v in module.state_dict().items()}
            self.rng = torch.get_rng_state()


def test_counting_the_epochs_batches_leaves_the_random_state_and_builds_no_loader_for_fit():
    """The final count builds the train dataloader (its iterator draws a seed): the random state
    is put back, and fit builds its own loader at the size."""
    module, before, finder, after = Validated(), Capture(), AutoBatchSize(max_batch=64), Capture()
    with simulated_memory("64MiB"):
        fit = trainer(before, finder, after, max_steps=4, val_check_interval=2)
        fit.fit(module)
    assert torch.equal(before.rng, after.rng)
    assert all(torch.equal(before.weights[k], after.weights[k]) for k in before.weights)
    assert finder.batch_size == 64 and module.seen[-4:] == [64] * 4 and module.validated_at == [2, 4]


class Plateau(Validated):
    """Its learning rate follows ``val_loss`` at each epoch's end (``ReduceLROnPlateau``)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


def test_the_check_run_validates_at_epoch_ends_where_the_interval_is_refused():
    """At a size whose epoch is shorter than the interval the check run validates at each epoch's
    end: its epoch-end plateau scheduler finds ``val_loss`` (no MisconfigurationException from
    inside the run), and the callback's own error follows."""
    with simulated_memory("64MiB"), pytest.raises(ValueError, match="AutoBatchSize: at batch size 512"):
        trainer(AutoBatchSize(), val_check_interval=INTERVAL).fit(Plateau())


def test_a_resumed_fit_checks_the_restored_size_too(tmp_path):
    """A checkpoint's size is set without a probe; an interval longer than its epoch is the same
    one error, not Lightning's from fit."""
    finder = AutoBatchSize()
    with simulated_memory("64MiB"):
        first = trainer(finder, max_steps=2)
        first.fit(Validated())
        first.save_checkpoint(tmp_path / "last.ckpt")
        resumed = AutoBatchSize()
        with pytest.raises(ValueError, match=f"at batch size {SAMPLES} an epoch has 1"):
            trainer(resumed, max_steps=4, val_check_interval=INTERVAL).fit(Validated(), ckpt_path=tmp_path / "last.ckpt")
    assert finder.batch_size == SAMPLES and resumed.result is None


# --- a batch size only in the datamodule's hparams -------------------------------------------


class HparamsData(pl.LightningDataModule):
    """``batch_size`` only in ``self.hparams`` (``save_hyperparameters()``), no attribute; records
    the batch size of every train dataloader it builds."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data = _data()
        self.built: list[int] = []

    def train_dataloader(self):
        self.built.append(self.hparams.batch_size)
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size)


class NoSize(pl.LightningModule):
    """A module without a batch size of its own (its data come from the datamodule), with
    ``hparams`` of its own."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
        self.seen: list[int] = []

    def training_step(self, batch, index):
        self.seen.append(batch[0].shape[0])
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_a_batch_size_only_in_the_datamodules_hparams_reaches_the_dataloader_it_builds():
    module, data, finder = NoSize(), HparamsData(), AutoBatchSize()
    assert not hasattr(data, "batch_size") and "batch_size" not in module.hparams
    with simulated_memory("2MiB") as device:
        trainer(finder, max_steps=3).fit(module, datamodule=data)
    size = finder.batch_size
    assert 2 < size < SAMPLES and device.oom_count >= 1  # the memory, not the dataset, set it
    assert data.hparams.batch_size == size and lightning_getattr(module, "batch_size") == size
    assert data.built[-1] == size and module.seen[-3:] == [size, SAMPLES - size, size]  # fit's epoch at it


def test_the_datamodules_hparams_get_a_global_batchs_micro_batch():
    module, data, finder = NoSize(), HparamsData(), AutoBatchSize(global_batch=256)
    with simulated_memory("2MiB"):
        fit = trainer(finder, max_steps=2)
        fit.fit(module, datamodule=data)
    assert data.hparams.batch_size * fit.accumulate_grad_batches == 256 == finder.batch_size * finder.accumulation
    assert data.built[-1] == finder.batch_size


def test_a_resumed_fit_sets_the_datamodules_hparams_from_the_checkpoint(tmp_path):
    finder = AutoBatchSize()
    with simulated_memory("2MiB"):
        first = trainer(finder, max_steps=2)
        first.fit(NoSize(), datamodule=HparamsData())
    first.save_checkpoint(tmp_path / "last.ckpt")
    data, resumed = HparamsData(), AutoBatchSize()  # no budget: the loaded checkpoint takes memory beside fit's
    trainer(resumed, max_steps=3).fit(NoSize(), datamodule=data, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.result is None and data.hparams.batch_size == finder.batch_size == data.built[-1]


def test_lightnings_batch_size_finder_writes_the_same_place(tmp_path):
    """Parity: Lightning's ``BatchSizeFinder`` (one trial, no OOM) sets ``datamodule.hparams``
    too; with no holder at all, AutoBatchSize's error names all four places."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    data = HparamsData()
    trainer(BatchSizeFinder(init_val=4, max_trials=1), max_steps=1, default_root_dir=str(tmp_path)).fit(
        NoSize(), datamodule=data)
    assert data.hparams.batch_size == 4 and data.built[-1] == 4
    with pytest.raises(AttributeError, match="the datamodule or its hparams"):
        trainer(AutoBatchSize(), max_steps=1).fit(NoSize())
