"""Review 22: ``Trainer(accumulate_grad_batches=4)`` with ``AutoBatchSize`` and no ``global_batch``.

Lightning counts the accumulation window within an epoch and steps at the epoch's end on the
batches it has (``_TrainingEpochLoop._should_accumulate``). With 512 samples, ``drop_last=True``
and the size 308, an epoch had one batch: the warning said each optimizer step trained
``4 x 308 = 1232`` samples, where Lightning stepped on 308 each epoch. The warning now says what
Lightning steps on, where the window does not divide the epoch's batches. The probe is stubbed to
a fixed answer (the warning is under test; the probes have their own tests); the samples of each
optimizer step are recorded from Lightning's own hooks."""

from __future__ import annotations

import re
import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import autobatch.integrations.lightning_trials as lightning_integration  # noqa: E402 (where the callback calls find_max_batch)
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

SAMPLES, WINDOW = 512, 4


class Recorded(pl.LightningModule):
    """512 samples, batch 2 (8 a step at accumulate_grad_batches=4); records each optimizer step's samples."""

    def __init__(self, drop_last: bool) -> None:
        super().__init__()
        self.batch_size, self.drop_last = 2, drop_last
        self.net = nn.Linear(4, 1)
        generator = torch.Generator().manual_seed(0)
        self.data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 4, generator=generator),
                                                   torch.randn(SAMPLES, 1, generator=generator))
        self.window: list[int] = []
        self.steps: list[int] = []

    def training_step(self, batch, index):
        self.window.append(batch[0].shape[0])
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer) -> None:
        self.steps.append(sum(self.window))
        self.window = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, drop_last=self.drop_last)


def _fit(monkeypatch, size: int, drop_last: bool) -> tuple[Recorded, list[str]]:
    answer = ProbeResult(batch_size=size, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                         elapsed_s=0.0, margin=0.0)
    monkeypatch.setattr(lightning_integration, "find_max_batch", lambda step, **options: answer)
    module = Recorded(drop_last)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=WINDOW,
                         callbacks=[AutoBatchSize(confirm=False)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    lines = [str(w.message) for w in caught if "accumulate_grad_batches=" in str(w.message)]
    return module, lines


def test_an_epoch_shorter_than_the_window_is_said_as_lightning_steps(monkeypatch):
    module, lines = _fit(monkeypatch, 308, drop_last=True)
    assert module.steps == [308, 308]  # Lightning: one batch an epoch, stepped at the epoch's end
    assert len(lines) == 1 and f"{WINDOW * 308} samples" not in lines[0]
    assert lines[0].startswith(
        "AutoBatchSize: an epoch at batch_size=308 has 1 batch(es) (308 samples), fewer than accumulate_grad_batches=4, "
        "and Lightning steps at each epoch's end on the batches it has: every optimizer step trains that epoch at 1/4 "
        "of the mean gradient")
    assert "pass global_batch=8 to keep 8 samples a step" in lines[0]
    suggested = int(re.search(r"max_batch=(\d+) ", lines[0]).group(1))  # a size whose epoch fills whole windows
    assert suggested <= 308 and (SAMPLES // suggested) % WINDOW == 0 and (SAMPLES // (suggested + 1)) % WINDOW != 0


def test_a_window_that_does_not_divide_the_epoch_names_the_last_step(monkeypatch):
    module, lines = _fit(monkeypatch, 100, drop_last=False)  # 6 batches an epoch (the last of 12)
    assert module.steps == [400, 112, 400, 112]
    assert len(lines) == 1 and lines[0].startswith(
        "AutoBatchSize: batch_size=100 with accumulate_grad_batches=4 (set on the Trainer) trains 400 samples per "
        "optimizer step where batch_size=2 trained 8")
    assert ("Also, an epoch at batch_size=100 has 6 batches, which accumulate_grad_batches=4 does not divide, and "
            "Lightning steps at each epoch's end on the batches it has: 1 step(s) an epoch train 4 batches and the "
            "last trains 2 batch(es) (at most 200 samples) at 2/4 of the mean gradient") in lines[0]
    assert "an accumulate_grad_batches that divides 6" in lines[0]


def test_a_window_that_divides_the_epoch_is_only_the_changed_samples(monkeypatch):
    module, lines = _fit(monkeypatch, 128, drop_last=True)  # 4 batches an epoch: one whole window
    assert module.steps == [512, 512]
    assert len(lines) == 1 and "trains 512 samples per optimizer step where batch_size=2 trained 8" in lines[0]
    assert "Also," not in lines[0] and "epoch's end" not in lines[0]


def test_one_window_with_a_partial_last_batch_is_the_epoch_per_step(monkeypatch):
    module, lines = _fit(monkeypatch, 163, drop_last=False)  # 4 batches (3 x 163 and 23): one window, 512 samples
    assert module.steps == [SAMPLES, SAMPLES]
    assert len(lines) == 1 and f"{WINDOW * 163} samples per optimizer step" not in lines[0]
    assert lines[0].startswith(
        "AutoBatchSize: an epoch at batch_size=163 has 4 batch(es) (512 samples), one window of "
        "accumulate_grad_batches=4, and Lightning steps at each epoch's end on the batches it has: every optimizer "
        "step trains that epoch, not 4 x 163 samples, where batch_size=2 trained 8 a step")
