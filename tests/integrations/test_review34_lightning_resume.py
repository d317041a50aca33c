"""Review 34: a Lightning run resumed with ``fit(ckpt_path=...)`` on less memory than the run that
wrote the checkpoint. The callback kept the checkpoint's batch size unchecked, and the first step
ran out of memory with torch's bare error. The size is now checked with one trial; where it does
not fit, the search steps down from it and the checkpoint's samples per optimizer step are split
into micro-batches that fit (one warning), the restored weights and optimizer state untouched."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations import lightning_trials  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import Capture, Tiny, trainer  # noqa: E402

SMALL = "1MiB"  # about 20 samples of Wide fit; the checkpoint's 64 do not


class Wide(Tiny):
    """Few weights, wide activations: a few dozen samples fill a MiB (fast trials)."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__(batch_size)
        self.net = nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of one step at 64 whose callback state says 64 x 1 (a machine with more memory)."""
    path = tmp_path_factory.mktemp("review34") / "run.ckpt"
    first = trainer()
    first.fit_loop.epoch_loop.max_steps = 1
    first.fit(Wide(batch_size=64))
    written = AutoBatchSize()
    written.batch_size = 64
    first.callbacks.append(written)  # its state goes into the checkpoint, as a run it sized writes it
    first.save_checkpoint(path)
    return path


def resumed(path, *callbacks, budget=SMALL, **options):
    module, run = Wide(), trainer(*callbacks, **options)
    run.fit_loop.epoch_loop.max_steps = 2
    with simulated_memory(budget), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(module, ckpt_path=path)
    return module, run, [str(w.message) for w in caught if "AutoBatchSize" in str(w.message)]


def test_review34_a_checkpoints_size_that_does_not_fit_is_searched_down_and_split(checkpoint):
    callback, after = AutoBatchSize(memory_limit=SMALL, confirm=False), Capture()
    module, run, said = resumed(checkpoint, callback, after)  # OutOfMemoryError at the first step before
    size, accumulation = callback.batch_size, callback.accumulation
    assert size < 64 and size * accumulation == 64 and run.accumulate_grad_batches == accumulation
    assert set(module.seen) == {size}  # from a mid-epoch checkpoint the first window is short (Lightning's count; warned)
    assert len(said) == 1 and "below the checkpoint's batch_size=64: this resumed run trains" in said[0]
    saved = torch.load(checkpoint, weights_only=True)
    assert all(torch.equal(after.model[k], v) for k, v in saved["state_dict"].items())  # the trials put them back
    state = run.optimizers[0].state_dict()["state"]
    assert state and all(int(moments["step"]) == 2 for moments in state.values())  # the checkpoint's moments, stepped


def test_review34_a_checkpoints_size_that_fits_costs_one_trial(checkpoint, monkeypatch):
    trials, probe = [], lightning_trials.find_max_batch

    def counted(*args, **kwargs):
        result = probe(*args, **kwargs)
        trials.extend(result.trials)
        return result

    monkeypatch.setattr(lightning_trials, "find_max_batch", counted)
    callback = AutoBatchSize(memory_limit="4MiB", confirm=False)
    module, run, said = resumed(checkpoint, callback, budget="4MiB")
    assert (callback.batch_size, callback.accumulation, module.seen) == (64, None, [64]) and not said
    assert [(t.batch_size, t.passed) for t in trials] == [(64, True)]


def test_review34_a_late_restored_size_above_what_the_probe_found_is_split(checkpoint):
    """Under a strategy that restores the callback's state after ``on_fit_start``, the probe has run:
    its answer bounds the checkpoint's size, with no trial more."""
    from test_lightning_probe import LateRestore

    callback = AutoBatchSize(memory_limit=SMALL, confirm=False)
    module, run, said = resumed(checkpoint, callback, strategy=LateRestore(torch.device("cpu")))
    size, accumulation = callback.batch_size, callback.accumulation
    assert size <= callback.result.batch_size < 64 and size * accumulation == 64
    assert set(module.seen) == {size} and len(said) == 1 and "below the checkpoint's batch_size=64" in said[0]


def test_review34_a_size_searched_down_on_resume_keeps_the_margin(checkpoint, monkeypatch):
    """The search below the checkpoint's size ran with no margin: its answer filled this machine's
    memory, with none of the room ``margin`` asked for. It comes off that answer now, as a probe's."""
    from autobatch.integrations import lightning

    found, kept = [], []
    probe, keep = lightning_trials.find_max_batch, lightning.kept_fits
    monkeypatch.setattr(lightning_trials, "find_max_batch", lambda *a, **k: found.append(probe(*a, **k)) or found[-1])
    monkeypatch.setattr(lightning, "kept_fits", lambda *a, **k: kept.append(keep(*a, **k)) or kept[-1])
    callback = AutoBatchSize(memory_limit=SMALL, confirm=False, margin=0.25)
    module, run, said = resumed(checkpoint, callback)
    assert found[0].batch_size < 64 and [fits for fits, _ in kept] == [int(found[0].batch_size * 0.75)]
    assert callback.batch_size <= kept[0][0] and callback.batch_size * callback.accumulation == 64


def test_review35_a_kept_size_keeps_the_margin_on_a_machine_with_less_memory(checkpoint):
    """Review 35: under 2 MiB the checkpoint's 64 passes its trial but the boundary is 74, so
    ``margin=0.25`` (64 needs a boundary of 86) was not kept: the size ran at the edge. Now the
    trial is at 86; it fails, and the search's answer less the margin splits the 64."""
    callback = AutoBatchSize(memory_limit="2MiB", confirm=False, margin=0.25)
    module, run, said = resumed(checkpoint, callback, budget="2MiB")
    size, accumulation = callback.batch_size, callback.accumulation
    assert size < 64 and size * accumulation == 64 and set(module.seen) == {size}
    assert len(said) == 1 and "below the checkpoint's batch_size=64" in said[0]


class Validating(Wide):
    """A validation step that needs four times a training sample's activations (as a val
    dataloader at a multiple of the batch size does): 64 passes the probe's step under 2 MiB, not
    Lightning's loop, which validates."""

    def validation_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(torch.cat([x] * 4))[: len(y)], y)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size)


def test_review35_a_kept_size_is_confirmed_in_lightnings_loop(checkpoint):
    """Review 35: a resumed size was checked with the probe's step only, so what Lightning's loop
    needs beyond it (here its validation batch) ran out of memory at the first validation, where a
    fresh fit's confirmation steps down. The kept size is now run in the loop too."""
    callback, after = AutoBatchSize(memory_limit="2MiB", max_batch=64, confirm_steps=1), Capture()
    module, run = Validating(), trainer(callback, after, val_check_interval=1, limit_val_batches=1)
    run.fit_loop.epoch_loop.max_steps = 2
    with simulated_memory("2MiB"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module, ckpt_path=checkpoint)  # OutOfMemoryError in the first validation before
    size, accumulation = callback.batch_size, callback.accumulation
    assert size < 64 and size * accumulation == 64 and callback.confirmation.batch_size >= size
    saved = torch.load(checkpoint, weights_only=True)
    assert all(torch.equal(after.model[k], v) for k, v in saved["state_dict"].items())  # the loop runs put them back
    state = run.optimizers[0].state_dict()["state"]
    assert state and all(int(moments["step"]) == 2 for moments in state.values())  # the checkpoint's moments, stepped


class ManualWide(Wide):
    """Wide stepping its optimizer itself (``automatic_optimization = False``), as a GAN does."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__(batch_size)
        self.automatic_optimization = False

    def training_step(self, batch, index):
        x, y = batch
        self.seen.append(x.shape[0])
        optimizer = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        optimizer.step()
        optimizer.zero_grad()


def test_review37_a_manual_optimization_resume_below_the_checkpoints_size_is_not_split(checkpoint):
    """Review 37: under manual optimization Lightning accumulates nothing (it refuses
    ``accumulate_grad_batches`` there before ``on_fit_start``), yet a resume under a lowered cap (or
    less memory) set 16 x accumulate_grad_batches=4 and warned that it kept the checkpoint's 64
    samples a step: each step trained 16, silently. It now trains the largest size allowed, says the
    samples per step change and how to keep them."""
    callback, module, run = AutoBatchSize(max_batch=24, confirm=False), ManualWide(), trainer()
    run.callbacks.append(callback)
    run.fit_loop.epoch_loop.max_steps = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(module, ckpt_path=checkpoint)
    said = [str(w.message) for w in caught if "AutoBatchSize" in str(w.message)]
    assert (callback.batch_size, callback.accumulation, run.accumulate_grad_batches) == (24, None, 1)
    assert set(module.seen) == {24} and module.hparams.batch_size == 24
    assert len(said) == 1 and "each optimizer step trains 24 samples where the checkpoint's run trained 64" in said[0]
    assert "step the optimizers every 4 batches) with AutoBatchSize(max_batch=16)" in said[0]
