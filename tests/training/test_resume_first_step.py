"""An interrupt in the first step of an epoch resumes exactly, by checkpoint or a second fit().

The interrupted run had made the epoch's iterator and drawn its first batch (a DataLoader draws
its workers' base seed at ``iter()`` and a shuffle's permutation at the first batch; a dataset
may draw augmentation in ``__getitem__``) before the step's random state was read. The resume
made the iterator afresh from that state, so it drew all of it a second time from where the
first draw had left it: another order, and every weight 0.05-0.09 away from the uninterrupted
run's. A checkpoint now says whether the step had drawn its batch (``batch_fetched``), and the
resume replays the epoch's start to draw it again.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from runner_workloads import assert_weights_close, make_model, mse, weights

EPOCHS, SAMPLES, GLOBAL = 2, 32, 8  # 4 steps an epoch, 2 micro-batches a step
CALLS_PER_EPOCH = 8  # loss_fn calls: 4 steps of 2 micro-batches


class _Augmented(Dataset):
    """Samples with noise drawn from torch's global generator in ``__getitem__``."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 6, generator=generator, dtype=torch.float64)
        self.y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return self.x[index] + 0.1 * torch.rand(6, dtype=torch.float64), self.y[index]


def _loader() -> DataLoader:
    return DataLoader(_Augmented(), batch_size=GLOBAL, shuffle=True, generator=torch.Generator().manual_seed(7))


def _runner(loss_fn=mse, **options) -> Runner:
    model = make_model(dropout=0.2)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=GLOBAL, micro_batch=4,
                  progress=False, log_every=None, **options)


def _interrupting(at_call: int):
    """``mse``, but a ``KeyboardInterrupt`` (a SIGTERM handler's) at loss_fn call ``at_call``."""
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if calls[0] == at_call:
            raise KeyboardInterrupt
        return mse(model, batch)

    return loss_fn


@pytest.fixture(scope="module")
def uninterrupted():
    runner = _runner()
    runner.fit(_loader(), epochs=EPOCHS)
    return weights(runner.model)


@pytest.mark.parametrize("at_call", [1, 2, CALLS_PER_EPOCH + 1],
                         ids=["epoch-0-forward-1", "epoch-0-forward-2", "epoch-1"])
def test_a_checkpoint_of_an_interrupted_first_step_resumes_exactly(tmp_path, uninterrupted, at_call):
    interrupted = _runner(_interrupting(at_call), checkpoint_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(_loader(), epochs=EPOCHS)
    assert interrupted.position == 0
    interrupted.save()  # "on SIGTERM: runner.save() and exit"
    saved = load_checkpoint(tmp_path / CHECKPOINT_NAME)

    resumed = _runner()
    result = resumed.fit(_loader(), epochs=EPOCHS, resume=tmp_path)
    assert result.steps == EPOCHS * SAMPLES // GLOBAL
    assert_weights_close(weights(resumed.model), uninterrupted)
    assert saved.get("batch_fetched") is True


@pytest.mark.parametrize("at_call", [1, CALLS_PER_EPOCH + 1], ids=["epoch-0", "epoch-1"])
def test_a_second_fit_after_an_interrupted_first_step_goes_on_exactly(uninterrupted, at_call):
    runner, loader = _runner(_interrupting(at_call)), _loader()
    with pytest.raises(KeyboardInterrupt):
        runner.fit(loader, epochs=EPOCHS)
    runner.fit(loader, epochs=EPOCHS)  # the same runner and loader go on
    assert runner.step == EPOCHS * SAMPLES // GLOBAL
    assert_weights_close(weights(runner.model), uninterrupted)


def test_an_epoch_end_checkpoint_starts_the_next_epoch_afresh(tmp_path, uninterrupted):
    """A checkpoint after whole epochs has drawn nothing of the next one: ``batch_fetched`` is
    False there, and the resume makes the next epoch's iterator from the saved state."""
    first = _runner(checkpoint_dir=tmp_path)
    first.fit(_loader(), epochs=1)
    state = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    resumed = _runner()
    resumed.fit(_loader(), epochs=EPOCHS, resume=tmp_path)
    assert_weights_close(weights(resumed.model), uninterrupted)
    assert (state["epoch"], state["position"], state.get("batch_fetched", False)) == (1, 0, False)


def test_a_checkpoint_without_the_flag_still_resumes_as_before(tmp_path):
    """Checkpoints of earlier versions have no ``batch_fetched``: they load, and position 0 starts
    the epoch afresh from the saved state, as it did."""
    interrupted = _runner(_interrupting(1), checkpoint_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(_loader(), epochs=EPOCHS)
    interrupted.save()
    path = tmp_path / CHECKPOINT_NAME
    state = load_checkpoint(path)
    state.pop("batch_fetched", None)
    save_checkpoint(state, path)
    resumed = _runner()
    result = resumed.fit(_loader(), epochs=EPOCHS, resume=tmp_path)
    assert result.steps == EPOCHS * SAMPLES // GLOBAL and result.samples == EPOCHS * SAMPLES
