"""Review 17: what a resume puts back beside the model. An EMA model updated in ``on_step_end``
is saved with each checkpoint (``Runner(extra_state=)``), and a loader that reads batches ahead
(a ``DataLoader``'s workers) resumed with another ``global_batch`` shuffles its later epochs as
the uninterrupted run did; a periodic checkpoint is written after its step's ``on_step_end``; a
``checkpoint_dir`` under ``~`` is under the home folder."""

from __future__ import annotations

import collections
import copy
import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from autobatch import CheckpointError, Runner
from runner_workloads import FEATURES, assert_weights_close, make_data, make_model, mse, weights


class Ema(nn.Module):
    """An exponential moving average of a model's weights, updated once a step (decay 0.9)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.average = copy.deepcopy(model).requires_grad_(False)
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for average, param in zip(self.average.parameters(), model.parameters()):
            average.lerp_(param, 0.1)
        self.updates += 1


def _ema_run(checkpoint_dir, steps, resume=None):
    model = make_model()
    ema = Ema(model)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    progress=False, checkpoint_dir=checkpoint_dir, extra_state={"ema": ema})
    runner.fit(make_data(48, 16), steps=steps, resume=resume, on_step_end=lambda info: ema.update(model))
    return ema


def test_an_ema_in_extra_state_resumes_as_the_uninterrupted_runs(tmp_path):
    """Before, the checkpoint had no place for it: resumed at step 2 of 6, the EMA weights
    ended 0.023 off the uninterrupted run's (``torch.optim.swa_utils.AveragedModel``, decay 0.9)."""
    reference = _ema_run(None, 6)
    _ema_run(tmp_path, 2)
    resumed = _ema_run(tmp_path, 6, resume=tmp_path)
    assert int(resumed.updates) == 6
    assert_weights_close(weights(resumed), weights(reference))


class Stopped(Exception):
    pass


def _warmup_run(checkpoint_dir, resume=None, fail_after=None):
    """A learning rate set by hand in ``on_step_end`` for the next step; the hook raises after
    step ``fail_after`` (a run killed there)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def warmup(info):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * (info["step"] + 1)
        if info["step"] == fail_after:
            raise Stopped

    runner = Runner(model, optimizer, mse, global_batch=16, micro_batch=16, progress=False,
                    checkpoint_dir=checkpoint_dir, checkpoint_every=2 if checkpoint_dir else None)
    try:
        runner.fit(make_data(96, 16), resume=resume, on_step_end=warmup)
    except Stopped:
        pass
    return weights(model)


def test_a_periodic_checkpoint_holds_what_its_steps_hook_set(tmp_path):
    """The checkpoint of step 4 was written before step 4's hook: it held the learning rate of
    step 4, and the resumed run trained step 5 with it (0.003 off). Written after the hook (here
    the hook raises, and the checkpoint is written before its error propagates), it resumes exactly."""
    reference = _warmup_run(None)
    _warmup_run(tmp_path, fail_after=4)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 4
    assert_weights_close(_warmup_run(tmp_path, resume=tmp_path), reference)


def test_an_extra_state_that_does_not_load_names_itself_and_loads_no_weights(tmp_path):
    _ema_run(tmp_path, 2)
    model = make_model()
    before = weights(model)
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    progress=False, extra_state={"ema": make_model(width=3)})
    with pytest.raises(CheckpointError, match=r"extra_state\['ema'\] does not load"):
        runner.fit(make_data(48, 16), resume=tmp_path)
    assert_weights_close(weights(model), before)


@pytest.mark.parametrize("extra_state, message", [
    ([make_model()], "must be a dict of name"),
    ({"rng": torch.Generator()}, r"extra_state\['rng'\] is a Generator, which has no state_dict\(\)"),
])
def test_extra_state_that_cannot_be_saved_is_refused_when_the_runner_is_made(extra_state, message):
    model = make_model()
    with pytest.raises(TypeError, match=message):
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, extra_state=extra_state)


class ReadAhead:
    """``BatchSampler`` batches read ahead of the run as a ``DataLoader``'s workers read them
    (``prefetch_factor * num_workers`` at ``iter()``, one more before each batch is taken): its
    ``RandomSampler`` draws its last permutation when the read-ahead, not the run, reaches the
    epoch's end."""

    def __init__(self, sampler: RandomSampler, batch_size: int, ahead: int = 4) -> None:
        self.sampler, self.ahead = sampler, ahead
        self.batches = BatchSampler(sampler, batch_size, drop_last=False)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        batches = iter(self.batches)
        queue = collections.deque(itertools.islice(batches, self.ahead))
        while queue:
            queue.extend(itertools.islice(batches, 1))
            yield queue.popleft()


def _order_run(checkpoint_dir, global_batch, steps=None, resume=None):
    samples = torch.arange(24)
    data = TensorDataset(torch.randn(24, FEATURES, dtype=torch.float64), torch.randn(24, 1, dtype=torch.float64), samples)
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(7))
    seen = []
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, batch: seen.extend(batch[2].tolist())
                    or mse(m, batch), global_batch=global_batch, micro_batch=global_batch, progress=False,
                    checkpoint_dir=checkpoint_dir)
    runner.fit(DataLoader(data, batch_sampler=ReadAhead(sampler, global_batch)), epochs=3, steps=steps, resume=resume)
    return seen


def test_a_resume_with_another_read_ahead_shuffles_later_epochs_as_the_uninterrupted_run(tmp_path):
    """Batches of 8 (3 an epoch, read 4 ahead as two workers do: past the epoch's end):
    the checkpoint after the first step holds the generator after the epoch's last draw; batches
    of 4 (6 an epoch) had not read that far, put it back and drew it again at the epoch's end,
    and epochs 2 and 3 trained another order."""
    reference = _order_run(None, 8)
    first = _order_run(tmp_path, 8, steps=1)
    resumed = _order_run(tmp_path, 4, resume=tmp_path)
    assert first + resumed == reference


def test_a_checkpoint_dir_under_the_home_folder_is_written_there(tmp_path, monkeypatch):
    """``checkpoint_dir="~/ckpt"`` made a folder named ``~`` in the working directory (which a
    cleanup ``rm -rf ~`` then aimed at the home folder); it is the home folder, as everywhere else."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    progress=False, checkpoint_dir="~/ckpt")
    runner.fit(make_data(48, 16), steps=1)
    assert (tmp_path / "home" / "ckpt" / "last.pt").is_file() and not (tmp_path / "~").exists()
    assert runner.fit(make_data(48, 16), steps=2, resume="~/ckpt").resumed_from["step"] == 1
