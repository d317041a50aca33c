"""Review 13: ``AutoBatchSize`` beside Lightning's ``LearningRateFinder``, and its lines in a
Lightning script.

Lightning moves tuner callbacks (``BatchSizeFinder``, ``LearningRateFinder``) to the front of
``trainer.callbacks``, so the learning-rate search ran at the module's own batch size and ``fit``
then trained at the callback's with that rate: on the CPU's simulated 3 MiB, the finder's steps
ran at 4 samples and ``fit`` at 544. The callback now runs first (it moves itself before the
finder in ``setup``), and the finder's checkpoint restore, which hands the callback back the state
it just set, is not taken for a resume. Its INFO lines (the size set) were shown nowhere in a
script that configures no logging; they now go where Lightning's own lines go.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import LearningRateFinder  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.integrations.lightning_tuners import tell  # noqa: E402
from conftest import LogLines  # noqa: E402


class Regression(pl.LightningModule):
    """A small regression whose loader follows ``hparams.batch_size`` and whose optimizer reads
    ``self.lr`` (where ``LearningRateFinder`` writes its suggestion); records each step's batch."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = 1e-3
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 1))
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(1024, 16, generator=generator),
                                                   torch.randn(1024, 1, generator=generator))
        self.seen: list[int] = []

    def training_step(self, batch, index):
        self.seen.append(batch[0].shape[0])
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size)


def test_the_learning_rate_is_found_at_the_batch_size_fit_trains_at(caplog, tmp_path):
    """Listed first, as a user writes it: Lightning still moved the finder ahead of it."""
    module, sizer = Regression(), AutoBatchSize()
    callbacks = [sizer, LearningRateFinder(num_training_steps=4)]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=str(tmp_path))
    with simulated_memory("1MiB"), caplog.at_level(logging.INFO, logger="autobatch"):
        trainer.fit(module)
    size = sizer.batch_size
    assert size > 4 and module.hparams.batch_size == size
    assert len(module.seen) == 4 + 6
    assert max(module.seen[:4]) == size  # the finder's 4 steps, at the size fit trains at (were all 4)
    assert max(module.seen[4:]) == size
    assert "restored from the checkpoint" not in caplog.text  # the finder's restore is not a resume



@pytest.mark.parametrize("autobatch_level", [logging.WARNING, logging.INFO])
def test_the_callbacks_lines_show_where_lightnings_do_unless_autobatch_logs_info(autobatch_level):
    """A Lightning script configures no logging: the ``autobatch`` logger's INFO lines (the size
    set) were shown nowhere, where Lightning shows its own tuners' lines through its logger's
    handler. Now such a line goes there; with ``autobatch`` at INFO it goes there instead (once)."""
    ours, theirs = logging.getLogger("autobatch"), logging.getLogger("lightning.pytorch")
    mine, lightning_lines = LogLines(), LogLines()
    level = ours.level
    ours.setLevel(autobatch_level)
    ours.addHandler(mine)
    theirs.addHandler(lightning_lines)
    try:
        tell("AutoBatchSize: %s=%d (probe %d)", "batch_size", 403, 403)
    finally:
        ours.setLevel(level)
        ours.removeHandler(mine)
        theirs.removeHandler(lightning_lines)
    line = ["AutoBatchSize: batch_size=403 (probe 403)"]
    assert (lightning_lines.lines, mine.lines) == ((line, []) if autobatch_level > logging.INFO else ([], line))


def test_a_fit_resumed_after_tuner_lr_find_takes_the_checkpoints_size(tmp_path):
    """``Tuner.lr_find`` stops its fit inside the finder's ``on_fit_start``, after the callback's (it
    runs first now), so no ``on_train_start`` marked the fit over: the next fit's checkpoint
    restore was taken for a restore into that stopped fit and dropped, and the resumed fit probed
    again instead of training at the checkpoint's size."""
    from lightning.pytorch.tuner import Tuner

    def make(sizer):
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[sizer],
                          default_root_dir=str(tmp_path))

    with simulated_memory("1MiB"):
        first = AutoBatchSize(confirm=False)
        trainer = make(first)
        trainer.fit(Regression())
        trainer.save_checkpoint(tmp_path / "run.ckpt")
    size = first.batch_size
    module, sizer = Regression(), AutoBatchSize(confirm=False)
    trainer = make(sizer)
    with simulated_memory("1MiB"):
        Tuner(trainer).lr_find(module, num_training=3)
        trainer.fit(module, ckpt_path=tmp_path / "run.ckpt")
    assert sizer.result is None and sizer.batch_size == size == module.hparams.batch_size  # restored, not probed
