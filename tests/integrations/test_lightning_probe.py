"""AutoBatchSize's probe runs what Lightning's loop runs, and leaves the module as fit finds it.

Each test is a case where the probe or the confirmation did something ``fit`` does not (CPU,
simulated budget): skipped batch hooks or input conversion, user callbacks fired by the trials,
module state (step outputs, counters, metrics) left changed, a size lost on resume, a validation
batch never checked, a batch larger than a rank's share of the data.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.global_batch import accumulation_for  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

SAMPLES, WIDTH, BUDGET = 512, 256, "2MiB"


class Small(pl.LightningModule):
    """Three linear layers on 8 features; its own data, its loader built from ``batch_size``."""

    def __init__(self, batch_size: int = 2, samples: int = SAMPLES) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        generator = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(samples, 8, generator=generator),
                                                   torch.randn(samples, 1, generator=generator))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, drop_last=True)


def trainer(*callbacks, **options):
    settings = dict(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(callbacks=list(callbacks), **{**settings, **options})


class AtTrainStart(pl.Callback):
    """Runs ``look(module)`` at ``on_train_start``, after AutoBatchSize's ``on_fit_start``."""

    def __init__(self, look) -> None:
        self.look, self.seen = look, None

    def on_train_start(self, trainer, module):
        self.seen = self.look(module)


def test_outputs_a_training_step_keeps_do_not_pile_up_over_the_trials():
    """Lightning 2's epoch-end pattern: training_step appends to ``self.training_step_outputs``,
    cleared at the epoch's end. The trials appended too and nothing took their tensors back: they
    piled up until batch 1 did not fit, and fit began with the probe's outputs in the list."""

    class Keeps(Small):
        def __init__(self):
            super().__init__()
            self.training_step_outputs = []

        def training_step(self, batch, index):
            x, y = batch
            hidden = self.net[:2](x)
            self.training_step_outputs.append(hidden.detach())
            return nn.functional.mse_loss(self.net[2:](hidden), y)

        def on_train_epoch_end(self):
            self.training_step_outputs.clear()

    module, look = Keeps(), AtTrainStart(lambda m: len(m.training_step_outputs))
    finder = AutoBatchSize(strategy="binary")
    with simulated_memory(BUDGET):
        trainer(finder, look, max_steps=-1, max_epochs=1).fit(module)
    assert look.seen == 0 and finder.batch_size > 16, (look.seen, finder.batch_size)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_true_precision_converts_the_probes_batches(precision):
    """Lightning's loop passes each batch through ``precision_plugin.convert_input``; the probe
    did not, and a float32 batch met float64 (or bfloat16) weights."""
    module, finder = Small(), AutoBatchSize()
    with simulated_memory("64MiB"):
        trainer(finder, precision=precision).fit(module)
    assert module.batch_size == finder.batch_size > 2


def test_the_batch_transfer_hooks_run_in_the_probe():
    """``on_before_batch_transfer`` / ``on_after_batch_transfer`` shape the batch the step sees
    (here: a tuple into a dict); the probe skipped them and its step met the raw tuple."""

    class Hooks(Small):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return {"x": batch[0], "y": batch[1]}

        def on_after_batch_transfer(self, batch, dataloader_idx):
            return {**batch, "x": batch["x"] * 1.0}

        def training_step(self, batch, index):
            return nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    module, finder = Hooks(), AutoBatchSize()
    with simulated_memory("64MiB"):
        trainer(finder).fit(module)
    assert module.batch_size == finder.batch_size > 2


class Counts(pl.Callback):
    def __init__(self) -> None:
        self.calls = {"before_backward": 0, "after_backward": 0, "before_optimizer_step": 0}

    def on_before_backward(self, trainer, module, loss):
        self.calls["before_backward"] += 1

    def on_after_backward(self, trainer, module):
        self.calls["after_backward"] += 1

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls["before_optimizer_step"] += 1


def test_the_probe_calls_no_user_callback():
    """The trials ran the precision plugin's backward and optimizer step, which call every
    callback's ``on_before_backward`` / ``on_after_backward`` / ``on_before_optimizer_step``."""
    counts = Counts()
    with simulated_memory(BUDGET):
        trainer(AutoBatchSize(strategy="binary"), counts, max_steps=3).fit(Small())
    assert counts.calls == {"before_backward": 3, "after_backward": 3, "before_optimizer_step": 3}


class Counting(Small):
    """State beside parameters and buffers: a Python counter, a list, a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.samples_seen, self.sizes, self.total = 0, [], torch.zeros(())

    def training_step(self, batch, index):
        self.samples_seen += len(batch[0])
        self.sizes.append(len(batch[0]))
        self.total += len(batch[0])  # in place, as a metric's state
        return super().training_step(batch, index)


@pytest.mark.parametrize("confirm", [False, True])
def test_module_state_beside_parameters_is_put_back(confirm):
    """The probe's and the confirmation's steps counted their samples into the module's plain
    attributes; fit started from those counts."""
    module, finder = Counting(), AutoBatchSize(strategy="binary", confirm=confirm)
    with simulated_memory(BUDGET):
        trainer(finder, max_steps=2).fit(module)
    trained = 2 * finder.batch_size
    assert module.samples_seen == trained and module.sizes == [finder.batch_size] * 2
    assert module.total.item() == trained


def test_torchmetrics_states_are_put_back():
    """A torchmetrics ``Metric`` keeps its state in plain attributes, updated in place."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Metered(Small):
        def __init__(self):
            super().__init__()
            self.samples = torchmetrics.SumMetric()

        def training_step(self, batch, index):
            self.samples.update(float(len(batch[0])))
            return super().training_step(batch, index)

    module, finder = Metered(), AutoBatchSize(strategy="binary")
    with simulated_memory(BUDGET):
        trainer(finder, max_steps=2).fit(module)
    assert module.samples.compute().item() == 2 * finder.batch_size


class LateRestore(pl.strategies.SingleDeviceStrategy):
    """Restores the checkpoint (callbacks included) after ``on_fit_start``, as some strategies do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


@pytest.mark.parametrize("late", [False, True], ids=["restored-before-fit-start", "restored-after"])
def test_a_resumed_fit_keeps_the_size_and_accumulation_it_trained_at(tmp_path, late):
    """``fit(ckpt_path=...)``: the checkpoint is held while the callback runs, so a new probe
    answered another size (other steps per epoch); the callback's state restores the size. The
    resumed run has more memory: a new probe would answer one batch of 384, no accumulation."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(epochs, path=None, budget=BUDGET):
        finder = AutoBatchSize(strategy="binary", global_batch=384)
        strategy = {"strategy": LateRestore(torch.device("cpu"))} if late else {}
        run = trainer(finder, ModelCheckpoint(dirpath=tmp_path, save_top_k=-1), max_steps=-1, max_epochs=epochs,
                      enable_checkpointing=True, **strategy)
        module = Small()
        with simulated_memory(budget):
            run.fit(module, ckpt_path=path)
        return finder, run, module

    first, run, _ = fit(1)
    (checkpoint,) = tmp_path.glob("*.ckpt")
    second, resumed, module = fit(2, checkpoint, "4MiB")
    assert (second.result is None) is not late and first.accumulation > 1  # no probe: the checkpoint's size
    assert (second.batch_size, second.accumulation) == (first.batch_size, first.accumulation)
    assert module.batch_size == first.batch_size and resumed.accumulate_grad_batches == first.accumulation
    assert resumed.global_step == 2 * run.global_step


class Validated(Small):
    """Validates twice in fit, on batches twice the training batch (no gradients there)."""

    def __init__(self):
        super().__init__(samples=4 * SAMPLES)

    def validation_step(self, batch, index):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=2 * self.batch_size)


def test_the_confirmation_runs_a_validation_batch():
    """The confirmation ran the loop without validation; fit's first validation (a batch twice
    the size, with the optimizer's state alive) ran out of memory at the size set."""
    module, finder = Validated(), AutoBatchSize(strategy="binary")
    with simulated_memory(BUDGET):
        trainer(finder, max_steps=4, val_check_interval=2, limit_val_batches=2).fit(module)  # no OOM
    assert any(run.validated for run in finder.confirmation.runs)


def test_global_batch_with_a_gradient_accumulation_scheduler_is_refused():
    """The scheduler sets ``accumulate_grad_batches`` per epoch: the global batch would not hold."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        trainer(AutoBatchSize(global_batch=256), GradientAccumulationScheduler({0: 2})).fit(Small())


def test_multiple_of_holds_with_a_global_batch():
    assert accumulation_for(1000, 488, multiple_of=8) == (5, 200)
    assert accumulation_for(1000, 488) == (4, 250)  # the default: unchanged
    with pytest.raises(ValueError, match="multiple_of"):
        accumulation_for(1000, 7, multiple_of=8)
    module, finder = Small(), AutoBatchSize(strategy="binary", multiple_of=8, global_batch=480)
    with simulated_memory(BUDGET):
        trainer(finder, max_steps=1).fit(module)
    assert module.batch_size % 8 == 0 and module.batch_size * finder.accumulation == 480
    with pytest.raises(ValueError, match="multiple_of=8"):
        trainer(AutoBatchSize(multiple_of=8, global_batch=300)).fit(Small())


def test_a_training_step_that_skips_its_first_batch_is_probed_on_the_next():
    """``training_step`` returning None skips the batch in Lightning's loop (here: batch 0,
    as a data-dependent initialisation does); the probe crashed on it."""

    class SkipsFirst(Small):
        def training_step(self, batch, index):
            return None if index == 0 else super().training_step(batch, index)

    module, finder = SkipsFirst(), AutoBatchSize(strategy="binary")
    with simulated_memory(BUDGET):
        trainer(finder).fit(module)
    assert 16 < finder.batch_size < SAMPLES


def test_a_training_step_that_never_trains_is_one_error():
    class Never(Small):
        def training_step(self, batch, index):
            return None

    with pytest.raises(ValueError, match="returned None"):
        trainer(AutoBatchSize()).fit(Never())


def test_a_dict_without_loss_is_one_error():
    class NoLoss(Small):
        def training_step(self, batch, index):
            return {"prediction": self.net(batch[0])}

    with pytest.raises(ValueError, match="'loss'"):
        trainer(AutoBatchSize()).fit(NoLoss())


def test_several_train_dataloaders_are_probed_together():
    """A dict of train loaders (Lightning combines them): each batch is a dict of their batches."""

    class Two(Small):
        def training_step(self, batch, index):
            return sum(nn.functional.mse_loss(self.net(x), y) for x, y in batch.values())

        def train_dataloader(self):
            loader = super().train_dataloader
            return {"a": loader(), "b": loader()}

    module, finder = Two(), AutoBatchSize(strategy="binary")
    with simulated_memory(BUDGET):
        trainer(finder).fit(module)
    assert 4 < finder.batch_size < SAMPLES
