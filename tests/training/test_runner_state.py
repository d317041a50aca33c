"""State outside the weights that a replay or a resume must keep exact.

* A replay puts back what the failed attempt's forward passes changed in the model's buffers
  (BatchNorm's running statistics and batch counter): the run ends as one that never failed.
* A resume draws a ``DataLoader(generator=...)``'s order as the interrupted run did: the
  loader's own generator is saved beside the global ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autobatch import FaultInjector, Runner
from autobatch.training.oom.buffer_guard import BufferGuard
from autobatch.training.checkpoints.checkpoint_io import data_generators

GLOBAL, MICRO = 10, 10


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def bn_data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(30, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(30, 1, generator=generator, dtype=torch.float64)
    return [(x[i : i + GLOBAL], y[i : i + GLOBAL]) for i in range(0, 30, GLOBAL)]


def bn_run(fault):
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    runner = Runner(model, optimizer, mse, global_batch=GLOBAL, micro_batch=MICRO, grow_after=None, progress=False,
                    faults=FaultInjector(fault) if fault else None)
    result = runner.fit(bn_data(), epochs=1)
    after = 10 if fault and fault[1] == "optimizer" else 5  # the micro-batch does not size the optimizer step
    expected = [(1, fault[1], 10, after)] if fault else []
    assert [(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"]) for r in result.oom_recoveries] == expected
    return model.state_dict()


@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_a_replay_puts_back_the_statistics_its_failed_forward_changed(phase):
    """Step 1 fails after its forward ran (in backward, in the optimizer step) and replays at
    micro-batch 5 (the optimizer step's at 10, the same): BatchNorm's statistics and counter must equal
    those of a step 1 that failed before any forward (on moving its first micro-batch), or of no
    OOM, bit for bit."""
    reference = bn_run(None if phase == "optimizer" else (1, "transfer"))
    state = bn_run((1, phase))
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    assert int(state["1.num_batches_tracked"]) == (3 if phase == "optimizer" else 1 + 2 + 2)  # steps 1-2 at 2 x 5


def test_the_buffer_guard_copies_only_what_changed_and_restores_a_replaced_buffer():
    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("average", torch.zeros(3))
            self.register_buffer("table", torch.arange(3.0))  # never changes

        def forward(self, x):
            self.average = 0.5 * self.average + 0.5 * x.mean(0)  # replaces the buffer object
            return x + self.table

    module = Ema()
    guard = BufferGuard(module)
    guard.capture()
    table_copy = guard._saved[(module, "table")][2]
    module(torch.ones(2, 3))
    guard.capture()  # the step after: 'average' changed, 'table' did not
    assert guard._saved[(module, "table")][2] is table_copy
    assert torch.equal(guard._saved[(module, "average")][2], torch.full((3,), 0.5))
    module(torch.ones(2, 3))  # a failed attempt's forward
    guard.restore()
    assert torch.equal(module.average, torch.full((3,), 0.5))
    module.table.add_(1)  # an in-place change is undone in place, the same tensor kept
    table = module.table
    guard.restore()
    assert module.table is table and torch.equal(table, torch.arange(3.0))


# -- a data loader's own generator ---------------------------------------------------------------
SAMPLES, BATCH, EPOCHS = 25, 10, 3  # 3 batches an epoch, the last short
TOTAL = 3 * EPOCHS


def seeded_loader(samples: int = SAMPLES):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = x.sum(1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=generator)


def linear_runner(**options):
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return Runner(model, optimizer, mse, global_batch=BATCH, micro_batch=BATCH, progress=False, **options)


def test_the_generators_of_a_loader_are_found_once():
    loader = seeded_loader()
    assert data_generators(loader) == [loader.generator]
    assert data_generators([1, 2]) == []


@pytest.mark.parametrize("stop", [3, 4, 7])
def test_a_resume_draws_a_seeded_loaders_order_as_the_interrupted_run(tmp_path, stop):
    """Stopped at an epoch boundary (3) or inside epoch 2 or 3 (4, 7), then resumed with a new
    loader seeded as the first: the weights equal the uninterrupted run's bit for bit."""
    uninterrupted = linear_runner()
    uninterrupted.fit(seeded_loader(), epochs=EPOCHS)
    first = linear_runner(checkpoint_dir=tmp_path)
    first.fit(seeded_loader(), epochs=EPOCHS, steps=stop)
    resumed = linear_runner(checkpoint_dir=tmp_path)
    result = resumed.fit(seeded_loader(), epochs=EPOCHS, resume=tmp_path)
    assert result.steps == TOTAL and result.steps_this_run == TOTAL - stop
    for mine, theirs in zip(resumed.model.parameters(), uninterrupted.model.parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("how", ["resume", "fit again"])
def test_a_run_stopped_at_an_epochs_end_by_steps_goes_on_in_the_uninterrupted_order(tmp_path, how):
    """30 samples in batches of 10: the last batch is whole, so RandomSampler draws its last
    (empty) permutation from the loader's generator only when the epoch's iterator is exhausted.
    A run stopped by ``steps`` at that batch must exhaust it too before counting the epoch, or
    the next epoch (resumed, or a second fit()) trains another order."""
    uninterrupted = linear_runner()
    uninterrupted.fit(seeded_loader(30), epochs=EPOCHS)
    if how == "resume":
        linear_runner(checkpoint_dir=tmp_path).fit(seeded_loader(30), epochs=EPOCHS, steps=3)
        runner = linear_runner()
        result = runner.fit(seeded_loader(30), epochs=EPOCHS, resume=tmp_path)
    else:
        runner, loader = linear_runner(), seeded_loader(30)
        runner.fit(loader, steps=3)
        result = runner.fit(loader, epochs=EPOCHS)
    assert result.steps == TOTAL and result.epochs == EPOCHS
    for mine, theirs in zip(runner.model.parameters(), uninterrupted.model.parameters()):
        assert torch.equal(mine, theirs)


def test_a_run_stopped_at_an_epochs_last_batch_has_completed_that_epoch():
    """``steps`` ending at an epoch's last batch counts the epoch, as ``epochs`` would."""
    by_steps = linear_runner().fit(seeded_loader(), steps=3)
    by_epochs = linear_runner().fit(seeded_loader(), epochs=1)
    assert by_steps.epochs == by_epochs.epochs == 1
    assert linear_runner().fit(seeded_loader(), steps=4).epochs == 1
