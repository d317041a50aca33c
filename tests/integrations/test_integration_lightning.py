"""AutoBatchSize with a real lightning.Trainer on the CPU under a simulated memory budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize, accumulation_for  # noqa: E402

SAMPLES, WIDTH = 512, 256
BUDGET = "2MiB"


class Tiny(pl.LightningModule):
    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator))
        self.seen: list[int] = []

    def training_step(self, batch, index):
        x, y = batch
        self.seen.append(x.shape[0])
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, drop_last=True)


class Capture(pl.Callback):
    """Copies of the module's and optimizer's state at fit start, where this callback runs."""

    def on_fit_start(self, trainer, module):
        with host_memory():  # the test's copies take none of the simulated device's memory
            self._take(trainer, module)

    def _take(self, trainer, module):
        self.model = {k: v.clone() for k, v in module.state_dict().items()}
        self.optimizer = repr(trainer.optimizers[0].state_dict())
        self.rng = torch.get_rng_state()
        self.seen = list(module.seen)


def trainer(*callbacks, **options):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), **options)


def test_sets_the_batch_size_and_fit_runs_at_it_under_the_same_budget():
    module = Tiny()
    before, after = Capture(), Capture()
    # no margin: the answer is confirmed in Lightning's own loop (finder.confirmation)
    finder = AutoBatchSize(strategy="binary", max_batch=SAMPLES)
    with simulated_memory(BUDGET) as device:
        trainer(before, finder, after).fit(module)
    size = finder.batch_size
    assert size == finder.confirmation.batch_size and 4 < size < SAMPLES and module.hparams.batch_size == size
    boundary = max(t.batch_size for t in finder.result.trials if t.passed)
    assert module.seen[len(after.seen):] == [size] * 4 and device.oom_count >= 1  # the probe met the boundary; fit never did
    # bit-exact restore: what the next callback saw is what the previous one saw
    assert before.model.keys() == after.model.keys()
    assert all(torch.equal(before.model[k], after.model[k]) for k in before.model)
    assert before.optimizer == after.optimizer and torch.equal(before.rng, after.rng)
    assert size >= 0.98 * boundary
    # and one more sample than the boundary does not fit (the captures hold the same memory)
    with simulated_memory(BUDGET), pytest.raises(torch.OutOfMemoryError):
        trainer(Capture(), Capture()).fit(Tiny(batch_size=boundary + 1))


def test_global_batch_through_accumulation():
    module = Tiny()
    finder = AutoBatchSize(strategy="binary", global_batch=384)
    with simulated_memory(BUDGET):
        fit = trainer(finder)
        fit.fit(module)
    assert finder.batch_size * finder.accumulation == 384 and finder.batch_size <= finder.result.batch_size
    assert fit.accumulate_grad_batches == finder.accumulation


def test_accumulation_for_keeps_the_global_batch():
    assert accumulation_for(384, 100) == (4, 96)
    assert accumulation_for(97, 50) == (97, 1)  # a prime: only batch 1 divides it below 97
    assert accumulation_for(64, 64) == (1, 64)


def test_missing_batch_attribute_is_a_clear_error():
    class NoSize(Tiny):
        def __init__(self):
            super().__init__()
            del self.hparams["batch_size"]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=4)

    with pytest.raises(AttributeError, match="batch_size"):
        trainer(AutoBatchSize()).fit(NoSize())


def test_dataloaders_passed_to_fit_are_refused_as_batch_size_finder_refuses_them():
    module = Tiny()
    with pytest.raises(ValueError, match="passed to fit"):
        trainer(AutoBatchSize()).fit(module, train_dataloaders=torch.utils.data.DataLoader(module.data, batch_size=7))


def test_global_batch_under_manual_optimization_is_refused():
    """Lightning accumulates only under automatic optimization: a global batch it would need
    accumulation for is one error, not a run at another global batch."""

    class Manual(Tiny):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, index):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))
            optimizer.step()

    with pytest.raises(ValueError, match="manual optimization"):
        trainer(AutoBatchSize(global_batch=200)).fit(Manual())


def test_per_sample_values_that_are_not_tensors_grow_with_the_batch():
    """A batch's per-sample lists (labels by name, file names, raw text) are resized with its
    tensors: the probe's batches had the first batch's labels, and the loss met 8 inputs and 4
    targets."""
    names = ["cat", "dog", "bird"]

    class Named(Tiny):
        def training_step(self, batch, index):
            target = torch.tensor([names.index(label) for label in batch["label"]], dtype=torch.float32)[:, None]
            return nn.functional.mse_loss(self.net(batch["x"]), target)

        def train_dataloader(self):
            samples = [{"x": self.data[i][0], "label": names[i % 3]} for i in range(SAMPLES)]
            return torch.utils.data.DataLoader(samples, batch_size=self.hparams.batch_size)

    module = Named()
    with simulated_memory(BUDGET):
        trainer(AutoBatchSize()).fit(module)
    assert module.hparams.batch_size > 2


def test_fit_still_runs_its_sanity_check_with_max_steps():
    """Putting the loop's state back marked it as restarting under max_steps (the fit loop's
    own setter keeps the flag for iteration-based training), and fit skipped its sanity check."""

    class Validated(Tiny):
        sanity = 0

        def validation_step(self, batch, index):
            self.sanity += self.trainer.sanity_checking

        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=16)

    module = Validated()
    with simulated_memory(BUDGET):
        trainer(AutoBatchSize(), num_sanity_val_steps=2, limit_val_batches=2).fit(module)
    assert module.sanity == 2


def test_the_batch_is_never_larger_than_the_dataset():
    module = Tiny()
    finder = AutoBatchSize()
    with simulated_memory("64MiB"):
        trainer(finder).fit(module)
    assert finder.batch_size == SAMPLES and module.seen[-1] == SAMPLES  # drop_last: a batch of the dataset trains


class Scheduled(Tiny):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=4)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_batch_start(self, batch, index):
        self.lrs = getattr(self, "lrs", []) + [self.trainer.optimizers[0].param_groups[0]["lr"]]


def test_the_learning_rate_schedulers_are_put_back():
    """The confirmation's loop runs step the schedulers; fit must start from step 0 of the
    schedule (a OneCycleLR of 4 steps would run out of steps in a 4-step fit)."""
    probed, plain = Scheduled(), Scheduled()
    finder = AutoBatchSize(strategy="binary", max_batch=SAMPLES)
    with simulated_memory(BUDGET):
        trainer(finder).fit(probed)
    trainer().fit(plain)
    assert probed.lrs[-4:] == plain.lrs[-4:]


class KeepsOutputs(Tiny):
    """Gathers every step's predictions for an epoch-end metric: memory grows batch by batch."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.data = torch.utils.data.TensorDataset(torch.randn(8 * SAMPLES, 8, generator=generator),
                                                   torch.randn(8 * SAMPLES, 1, generator=generator))

    def training_step(self, batch, index):
        x, y = batch
        prediction = self.net(x)
        return {"loss": nn.functional.mse_loss(prediction, y), "prediction": prediction.detach().repeat(1, 16)}

    def on_train_epoch_start(self):
        self.kept = []

    def on_train_batch_end(self, outputs, batch, index):
        self.kept.append(outputs["prediction"])


def test_what_the_loop_keeps_batch_after_batch_is_carried_to_the_epochs_end():
    """Three confirmation steps see the kept outputs grow; carried to the epoch's end they step
    the size down, and a whole epoch of fit trains under the same budget."""
    module = KeepsOutputs()
    finder = AutoBatchSize(strategy="binary")
    with simulated_memory(BUDGET):
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[finder]).fit(module)
    grown = [run for run in finder.confirmation.runs if run.growth_bytes]
    assert grown and finder.batch_size < finder.result.batch_size
    assert len(module.kept) == 8 * SAMPLES // finder.batch_size  # the whole epoch trained


def test_a_global_batch_larger_than_the_dataset_is_one_error():
    """Each epoch would end before one global batch: refused, naming both figures."""
    with simulated_memory("64MiB"), pytest.raises(ValueError, match=f"global_batch={4 * SAMPLES} is larger than"):
        trainer(AutoBatchSize(global_batch=4 * SAMPLES)).fit(Tiny())
