"""Review 12: learning-rate schedules sized from the step count, under AutoBatchSize.

Lightning calls ``configure_optimizers`` in ``strategy.setup``, before the ``on_fit_start`` hook in
which the callback sets the batch size. ``OneCycleLR(total_steps=self.trainer.estimated_stepping_batches)``
with ``interval="step"`` (Lightning's documented pattern) was so sized for the module's own batch
size: on 320 samples over 2 epochs, a module batch of 4 sized it for 160 steps where fit, at the
callback's 64, ran 10 (the learning rate never annealed), and a module batch of 128 sized it for 6
where fit, at a probed 81, ran 8: ``ValueError: Tried to step 7 times`` at the end of training.
Now ``configure_optimizers`` runs again once the size is set, where that is safe
(:mod:`autobatch.integrations.lightning_schedules`); elsewhere one warning says what to change.
"""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.integrations.lightning_schedules import StepSchedule, unsafe  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402

SAMPLES, EPOCHS, MAX_LR = 320, 2, 0.1
FINAL_LR = MAX_LR / 25 / 1e4  # OneCycleLR's end: max_lr / div_factor / final_div_factor (its defaults)


def _data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=generator),
                                          torch.randn(SAMPLES, 1, generator=generator))


class Scheduled(pl.LightningModule):
    """A small regression module whose train dataloader follows ``batch_size``. Its
    ``configure_optimizers`` sizes the schedule from ``self.trainer.estimated_stepping_batches``
    (``schedule``: ``"one_cycle"`` or ``"linear"``, stepped by optimizer step; ``"epoch"``, a StepLR
    stepped by epoch; None, no scheduler) and records each call's (batch size, steps); the learning
    rate of every optimizer step fit takes is recorded in ``lrs``."""

    def __init__(self, batch_size: int = 4, width: int = 64, schedule: str | None = "one_cycle") -> None:
        super().__init__()
        self.batch_size, self.schedule = batch_size, schedule
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
        self.data = _data()
        self.configured: list[tuple[int, int]] = []
        self.seen: list[int] = []
        self.lrs: list[float] = []

    def training_step(self, batch, index):
        self.seen.append(batch[0].shape[0])
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=MAX_LR, momentum=0.9)
        if self.schedule is None:
            return optimizer
        total = self.trainer.estimated_stepping_batches
        self.configured.append((self.batch_size, total))
        if self.schedule == "epoch":
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}
        if self.schedule == "one_cycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, total_steps=total)
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


def trainer(*callbacks, **options):
    settings = dict(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(callbacks=list(callbacks), **{**settings, **options})


class Capture(pl.Callback):
    """Where this callback's ``on_fit_start`` runs: the optimizer and scheduler objects, the
    module's weights and the random state."""

    def on_fit_start(self, trainer, module):
        self.optimizer = trainer.optimizers[0]
        self.schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        with host_memory():
            self.weights = {k: v.clone() for k, v in module.state_dict().items()}
            self.rng = torch.get_rng_state()


def _steps(size: int, accumulation: int = 1) -> int:
    return math.ceil(math.ceil(SAMPLES / size) / accumulation) * EPOCHS


def test_the_reproduction_without_the_new_configure_optimizers_call(monkeypatch):
    """What fit did before: a schedule sized at the module's 128 is stepped past its total at the
    probed size (smaller), and one sized at the module's 4 never peaks nor anneals at 64."""
    monkeypatch.setattr(StepSchedule, "resize", lambda *args: False)
    module, finder = Scheduled(batch_size=128, width=1024), AutoBatchSize()
    with simulated_memory("1MiB"), pytest.raises(ValueError, match="Tried to step .* total steps is 6"):
        trainer(finder).fit(module)
    assert finder.batch_size < 128 and _steps(finder.batch_size) > 6
    module = Scheduled()
    with simulated_memory("64MiB"):
        fit = trainer(AutoBatchSize(max_batch=64))
        fit.fit(module)
    assert fit.lr_scheduler_configs[0].scheduler.total_steps == 160 and fit.global_step == 10
    assert max(module.lrs) < 0.2 * MAX_LR  # still warming up when training ended: no peak, no annealing


@pytest.mark.parametrize("confirm", [True, False])
def test_a_one_cycle_schedule_sized_at_a_larger_module_batch_now_trains_to_its_end(confirm):
    """The crash case: the probe answers less than the module's 128 under 1 MiB; the schedule is
    sized at that size, fit runs exactly its total steps and ends at OneCycleLR's final rate."""
    module, finder = Scheduled(batch_size=128, width=1024), AutoBatchSize(confirm=confirm)
    with simulated_memory("1MiB") as device:
        fit = trainer(finder)
        fit.fit(module)
    size = finder.batch_size
    assert size < 128 and device.oom_count >= 1
    scheduler = fit.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == fit.global_step == _steps(size) == len(module.lrs)
    assert module.configured == [(128, 6), (size, _steps(size))]
    assert module.lrs[-1] == pytest.approx(FINAL_LR)


def test_a_larger_size_anneals_the_schedule_to_its_end_with_the_users_hyperparameters(caplog):
    """At 64 (the module's 4) fit runs 10 steps: the schedule is sized for them, starts at the
    module's own initial rate, peaks at its max_lr and ends at the final rate. One INFO line says
    why; the module's weights, the random state and fit's dataloader are left as they were."""
    module, before, finder, after = Scheduled(), Capture(), AutoBatchSize(max_batch=64), Capture()
    with simulated_memory("64MiB"), caplog.at_level(logging.INFO, logger="autobatch"):
        fit = trainer(before, finder, after)
        fit.fit(module)
    scheduler = fit.lr_scheduler_configs[0].scheduler
    assert finder.batch_size == 64 and scheduler.total_steps == fit.global_step == 10
    assert module.lrs[0] == pytest.approx(MAX_LR / 25) and max(module.lrs) == pytest.approx(MAX_LR)
    assert module.lrs[-1] == pytest.approx(FINAL_LR)
    assert fit.optimizers[0].defaults["lr"] == MAX_LR and fit.optimizers[0].defaults["momentum"] == 0.9
    assert after.optimizer is fit.optimizers[0] is not before.optimizer  # the new ones train
    assert after.schedulers == [scheduler] and before.schedulers[0].total_steps == 160
    assert torch.equal(before.rng, after.rng)
    assert all(torch.equal(before.weights[k], after.weights[k]) for k in before.weights)
    assert module.seen == [64] * 10  # fit built its own loader at the size
    lines = [r.getMessage() for r in caplog.records if "configure_optimizers again" in r.getMessage()]
    assert len(lines) == 1 and "OneCycleLR" in lines[0]
    assert "160 optimizer steps at batch_size=4" in lines[0] and "fit will run 10 at batch_size=64" in lines[0]


def test_a_global_batch_sizes_the_schedule_for_the_accumulation_it_sets():
    """``global_batch=64`` at most 16 a micro-batch: 16 x 4, 10 optimizer steps where the module's
    32 (no accumulation) sized the schedule for 20."""
    module, finder = Scheduled(batch_size=32), AutoBatchSize(global_batch=64, max_batch=16)
    with simulated_memory("64MiB"):
        fit = trainer(finder)
        fit.fit(module)
    assert (finder.batch_size, fit.accumulate_grad_batches) == (16, 4)
    assert fit.lr_scheduler_configs[0].scheduler.total_steps == fit.global_step == _steps(16, 4) == 10
    assert module.configured == [(32, 20), (16, 10)] and module.lrs[-1] == pytest.approx(FINAL_LR)


@pytest.mark.parametrize("schedule, batch, options, steps", [
    (None, 4, dict(max_batch=64), None),  # no scheduler
    ("epoch", 4, dict(max_batch=64), 160),  # stepped by epoch: the epochs do not change
    ("one_cycle", 4, dict(max_batch=64, trainer=dict(max_steps=10, max_epochs=-1)), 10),  # counted by max_steps
    ("one_cycle", 200, dict(max_batch=300), 4),  # 200 and 300 both take 2 batches of 320 samples
])
def test_schedules_whose_step_count_did_not_change_are_left_alone(caplog, schedule, batch, options, steps):
    """Same optimizer and schedulers, no log line: the optimizers Lightning configured train (the
    callback calls configure_optimizers once more where the size changed, to compare the
    hyperparameters it gives, and drops what that made: review 22)."""
    options = dict(options)
    settings = options.pop("trainer", {})
    module, before, after = Scheduled(batch_size=batch, schedule=schedule), Capture(), Capture()
    finder = AutoBatchSize(**options)
    with simulated_memory("64MiB"), caplog.at_level(logging.INFO, logger="autobatch"):
        fit = trainer(before, finder, after, **settings)
        fit.fit(module)
    assert finder.batch_size == options["max_batch"]
    assert after.optimizer is before.optimizer is fit.optimizers[0]
    assert after.schedulers == before.schedulers == [c.scheduler for c in fit.lr_scheduler_configs]
    assert module.configured[:1] == ([] if schedule is None else [(batch, steps)]) and len(module.configured) <= 2
    assert torch.equal(before.rng, after.rng)
    assert not any("configure_optimizers again" in r.getMessage() for r in caplog.records)


def _first_run(tmp_path, max_batch: int) -> tuple[Scheduled, pl.Trainer]:
    """Two epochs at ``max_batch`` with a linear decay to 0, a checkpoint after each epoch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = Scheduled(schedule="linear")
    saving = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    with simulated_memory("64MiB"):
        fit = trainer(AutoBatchSize(max_batch=max_batch), saving, enable_checkpointing=True)
        fit.fit(module)
    total = _steps(max_batch)
    assert module.configured[-1] == (max_batch, total) and len(module.lrs) == total
    assert fit.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == 0.0  # the decay's end
    return module, fit


def test_a_resumed_fit_sizes_the_schedule_at_the_checkpoints_size_and_restores_its_state(tmp_path):
    """Resumed from the first epoch's checkpoint, the module at its own 4 again: the schedule is
    configured at 4 (160 steps), configured again at the checkpoint's 64 (10), and Lightning then
    loads the optimizer's momentum and the scheduler's step into the new ones: the second epoch
    trains at the first run's learning rates, to the same weights, and the decay ends at 0."""
    first, _ = _first_run(tmp_path, 64)
    module, finder = Scheduled(schedule="linear"), AutoBatchSize()
    fit = trainer(finder)
    fit.fit(module, ckpt_path=tmp_path / "epoch=0.ckpt")
    assert finder.result is None and finder.batch_size == 64 and fit.global_step == 10
    assert module.configured == [(4, 160), (64, 10)]
    assert module.lrs == first.lrs[5:] and fit.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), first.state_dict().values()))


class LateRestore(SingleDeviceStrategy):
    """Restores the checkpoint's modules and callbacks after ``on_fit_start`` (as FSDP and
    DeepSpeed do), with Lightning's own optimizer set-up."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def test_a_checkpoints_size_restored_after_fit_start_sizes_the_schedule_again(tmp_path):
    """The probe's 64 sizes the schedule at fit start (10 steps); the checkpoint's 32, loaded
    after, sizes it again (20): the second epoch trains at the first run's rates."""
    first, _ = _first_run(tmp_path, 32)
    module, finder = Scheduled(schedule="linear"), AutoBatchSize(max_batch=64)
    with simulated_memory("64MiB"):
        fit = trainer(finder, strategy=LateRestore(device=torch.device("cpu")))
        fit.fit(module, ckpt_path=tmp_path / "epoch=0.ckpt")
    assert finder.batch_size == 32 and fit.global_step == 20
    assert module.configured == [(4, 160), (64, 10), (32, 20)]
    assert module.lrs == first.lrs[10:] and fit.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == 0.0


class LoadsOptimizers(LateRestore):
    """Loads the optimizer states itself, with the checkpoint, before the callbacks' (as FSDP
    does: ``lightning_restore_optimizer`` is False)."""

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False


def test_a_strategy_that_loaded_the_optimizer_states_is_not_configured_again(tmp_path):
    """At fit start the optimizers are fresh: the probe's 64 sizes the schedule (10 steps). The
    checkpoint's 32 comes after the strategy loaded the optimizer states: new optimizers would
    lose them, so the schedule stays at 10 steps and one warning says so."""
    _first_run(tmp_path, 32)
    module, finder = Scheduled(schedule="linear"), AutoBatchSize(max_batch=64)
    with simulated_memory("64MiB"), pytest.warns(UserWarning, match="hold state already") as record:
        fit = trainer(finder, strategy=LoadsOptimizers(device=torch.device("cpu")))
        fit.fit(module, ckpt_path=tmp_path / "epoch=0.ckpt")
    warned = [str(w.message) for w in record if str(w.message).startswith("AutoBatchSize: the learning-rate")]
    assert len(warned) == 1 and "for 10 optimizer steps at batch_size=64" in warned[0]
    assert "fit will run 20 at batch_size=32" in warned[0]
    assert finder.batch_size == 32 and module.configured == [(4, 160), (64, 10)]


class Engine(SingleDeviceStrategy):
    """Sets its optimizers up its own way, as DeepSpeed's engine does (here: marks them)."""

    def setup(self, trainer):
        super().setup(trainer)
        for optimizer in self.optimizers:
            optimizer.engine = True


class Wrapping(Precision):
    """A precision plugin whose ``connect`` may wrap the optimizers."""

    def connect(self, model, optimizers, lr_schedulers):
        return model, optimizers, lr_schedulers


class Stateful(pl.Callback):
    """Gives the optimizer state before the callback runs (as FSDP's resume loads it)."""

    def on_fit_start(self, trainer, module):
        parameter = next(module.parameters())
        trainer.optimizers[0].state[parameter]["momentum_buffer"] = torch.zeros_like(parameter)


@pytest.mark.parametrize("setting, why", [
    (dict(strategy=Engine(device=torch.device("cpu"))), "the Engine strategy sets up its optimizers its own way"),
    (dict(plugins=[Wrapping()]), "the precision plugin Wrapping wraps the optimizers"),
    (dict(callbacks=[Stateful()]), "the optimizers hold state already"),
])
def test_where_configure_optimizers_cannot_run_again_one_warning_says_what_to_change(setting, why):
    options = dict(setting)
    callbacks = options.pop("callbacks", [])
    module, before, finder = Scheduled(), Capture(), AutoBatchSize(max_batch=64)
    with simulated_memory("64MiB"), pytest.warns(UserWarning) as record:
        fit = trainer(*callbacks, before, finder, **options)
        fit.fit(module)
    warned = [str(w.message) for w in record if str(w.message).startswith("AutoBatchSize: the learning-rate")]
    assert len(warned) == 1
    assert "scheduler(s) OneCycleLR" in warned[0] and why in warned[0]
    assert "for 160 optimizer steps at batch_size=4" in warned[0] and "fit will run 10 at batch_size=64" in warned[0]
    assert "Set batch_size=64 (and accumulate_grad_batches=1)" in warned[0]
    assert fit.optimizers[0] is before.optimizer and module.configured == [(4, 160)]
    assert fit.lr_scheduler_configs[0].scheduler.total_steps == 160 and fit.global_step == 10


def test_deepspeed_is_not_configured_again():
    """DeepSpeed's strategy (a DDP subclass) builds its engine around the optimizers in its own
    ``setup``: no second ``configure_optimizers`` (checked without DeepSpeed installed)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    stub = types.SimpleNamespace(strategy=object.__new__(DeepSpeedStrategy))
    assert unsafe(stub).startswith("the DeepSpeedStrategy strategy sets up its optimizers its own way")


def test_a_schedule_shorter_than_the_check_run_is_not_stepped_by_it():
    """At the module's own 320 (every sample in one batch) the schedule is sized for 2 steps; the
    probe answers less under 1 MiB, and the callback's check run at that size takes 3 optimizer
    steps: OneCycleLR raised ``Tried to step 3 times`` from inside it. The run steps no schedule
    (its memory does not follow the learning rate); fit then trains at the size set, the schedule
    sized for it, and ends it."""
    module, finder = Scheduled(batch_size=SAMPLES, width=1024), AutoBatchSize()
    with simulated_memory("1MiB"):
        fit = trainer(finder)
        fit.fit(module)
    assert finder.batch_size < SAMPLES // 2 and max(run.steps for run in finder.confirmation.runs) == 3
    scheduler = fit.lr_scheduler_configs[0].scheduler
    assert "step" not in vars(scheduler)  # the class's own step again
    assert fit.global_step == scheduler.total_steps == _steps(finder.batch_size) == len(module.lrs)
    assert module.lrs[-1] == pytest.approx(FINAL_LR)
