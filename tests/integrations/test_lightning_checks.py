"""AutoBatchSize refuses what would not train as asked, with one error naming what to change.

Each test is a case that passed silently or failed late: a ``global_batch`` that
``limit_train_batches`` cut (each optimizer step trained fewer samples), ``multiple_of=0`` (a bare
``ZeroDivisionError`` at fit start), ``max_batch=0`` (read as no cap).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

SAMPLES, WIDTH = 512, 64


class Small(pl.LightningModule):
    """Two linear layers on 8 features; its loader built from ``batch_size``, without ``drop_last``."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator),
                                                   torch.randn(SAMPLES, 1, generator=generator))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


class SamplesPerStep(pl.Callback):
    """The samples each optimizer step trained."""

    def __init__(self) -> None:
        self.per_step, self.count = [], 0

    def on_train_batch_start(self, trainer, module, batch, index):
        self.count += batch[0].shape[0]

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.per_step.append(self.count)
        self.count = 0


def trainer(*callbacks, **options):
    settings = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(callbacks=list(callbacks), **{**settings, **options})


def finder(**options) -> AutoBatchSize:
    """A global batch of 500 with micro-batches of at most 100: 5 x 100 (6 batches an epoch)."""
    return AutoBatchSize(strategy="binary", max_batch=100, global_batch=500, steps_per_trial=1, **options)


@pytest.mark.parametrize("limit, batches", [(2, 2), (0.5, 3)])
def test_a_limit_that_cuts_the_global_batch_is_one_error(limit, batches):
    """500 samples at 100 a batch need 5 batches an epoch; 2 (or half of 6) trained 200 or 300
    samples per optimizer step, without a word."""
    with simulated_memory("64MiB"), pytest.raises(ValueError) as info:
        trainer(finder(confirm=False), limit_train_batches=limit).fit(Small())
    message = str(info.value)
    assert f"limit_train_batches={limit} leaves {batches} batch(es) of 100" in message
    assert "global_batch=500" in message and "5 batches or more" in message


def test_a_limit_that_keeps_the_global_batch_trains_it():
    """At 5 batches (or a fraction that leaves 5 of the 6) every step trains the global batch; the
    confirmation in Lightning's loop runs its steps under the user's limit too."""
    counted, chosen = SamplesPerStep(), finder()
    with simulated_memory("64MiB"):
        trainer(chosen, counted, limit_train_batches=5).fit(Small())
    assert (chosen.batch_size, chosen.accumulation) == (100, 5) and counted.per_step == [500, 500]
    with simulated_memory("64MiB"):
        trainer(finder(confirm=False), limit_train_batches=0.9, max_steps=1).fit(Small())  # int(6 * 0.9) == 5


def test_review39_a_limit_under_the_trainers_own_accumulation_names_removing_it():
    """The Trainer's own accumulate_grad_batches=4 is kept (64 x 4 for 256), and 3 batches an epoch
    cut it: the error named only a higher limit or a lower global_batch, though 256 x 1 fits and
    trains within 3 batches. It names removing the Trainer's setting too; without it, 256 x 1 trains."""
    def callback():
        return AutoBatchSize(strategy="binary", global_batch=256, steps_per_trial=1, confirm=False)

    with simulated_memory("64MiB"), pytest.raises(ValueError, match=r"leaves 3 batch\(es\) of 64 .* raise limit_train_batches "
                                                  r"to 4 batches or more, remove \(or lower\) the Trainer's own "
                                                  r"accumulate_grad_batches=4 \(global_batch then sets 1 micro-batch of "
                                                  r"256 a step, which the probe found fit, within the limit\), or lower"):
        trainer(callback(), accumulate_grad_batches=4, limit_train_batches=3).fit(Small())
    counted, removed = SamplesPerStep(), callback()
    with simulated_memory("64MiB"):
        trainer(removed, counted, limit_train_batches=3, max_steps=1).fit(Small())
    assert (removed.batch_size, removed.accumulation) == (256, 1) and counted.per_step == [256]


def test_bad_probe_options_are_refused_when_the_callback_is_built():
    with pytest.raises(ValueError, match="multiple_of must be a positive integer, got 0"):
        AutoBatchSize(multiple_of=0, global_batch=64)
    with pytest.raises(ValueError, match="steps_per_trial"):
        AutoBatchSize(steps_per_trial=0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        AutoBatchSize(strategy="doubling")
    with pytest.raises(ValueError, match="start"):
        AutoBatchSize(probe_options={"start": 0})
    with pytest.raises(TypeError, match="'device' \\(the callback sets it\\)"):
        AutoBatchSize(probe_options={"device": "cpu"})
    with pytest.raises(TypeError, match="'bogus' \\(find_max_batch does not take it\\)"):
        AutoBatchSize(probe_options={"bogus": 1})
    with pytest.raises(TypeError, match="pass margin as AutoBatchSize's own argument"):
        AutoBatchSize(probe_options={"margin": 0.1})


def test_max_batch_zero_is_refused_not_read_as_no_cap():
    with pytest.raises(ValueError, match="max_batch must be a positive integer or None, got 0"):
        AutoBatchSize(max_batch=0)
    with pytest.raises(ValueError, match="max_batch=4 is smaller than multiple_of=8"):
        AutoBatchSize(max_batch=4, multiple_of=8)


@pytest.mark.parametrize("global_batch", [None, 64])
def test_a_numpy_multiple_of_is_kept_as_a_plain_int(global_batch):
    """A NumPy multiple_of made the batch size written to the module a NumPy integer: the
    DataLoader refused it, or the accumulation check did, after the whole probe had run."""
    import numpy as np

    finder = AutoBatchSize(strategy="binary", max_batch=32, steps_per_trial=1, multiple_of=np.int64(8),
                           global_batch=global_batch)
    assert type(finder.probe_options["multiple_of"]) is int
    module = Small()
    with simulated_memory("64MiB"):
        trainer(finder).fit(module)
    assert type(module.batch_size) is int and module.batch_size % 8 == 0


def test_the_summary_of_runs_that_all_ran_out_of_memory_claims_no_batch():
    """The "no batch trained" error embedded a summary that began "batch N trained"."""
    from autobatch.integrations.lightning_loop import LoopConfirmation, LoopRun

    failed = LoopRun(batch_size=256, passed=False, steps=0, peak_bytes=2**20, probe_bytes=2**19, extra_bytes=2**19,
                     seconds=0.1, error="out of memory")
    confirmation = LoopConfirmation(batch_size=512, probed=512, limit_bytes=2**21, runs=[failed])
    runs = confirmation.runs_summary()
    assert runs.startswith("OOM at 256") and "trained" not in runs
    assert confirmation.summary().endswith("runs: " + runs)
