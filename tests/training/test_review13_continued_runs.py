"""Runs continued after a stop end with the weights of a run never stopped.

An interrupt while a ``micro_batch=None`` runner planned its first batch left it with no
micro-batch: ``save()`` wrote ``micro_batch: None``, whose resume failed with ``TypeError: '>'
not supported between 'int' and 'NoneType'``, and a second ``fit()`` with ``ValueError:
micro_batch must be a positive integer, got None``. And a second ``fit()`` handed a new
``DataLoader`` built like the first (a notebook cell run again) after a stop inside an epoch put
the new loader's generator back to its fresh state after replaying the epoch, so the next epoch
drew the first epoch's order again (0.03 off the uninterrupted run's weights).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autobatch

GENERATOR = torch.Generator().manual_seed(0)
X, Y = torch.randn(24, 5, generator=GENERATOR, dtype=torch.float64), torch.randn(24, 1, generator=GENERATOR, dtype=torch.float64)


def loader() -> DataLoader:
    """A shuffled loader with its own seeded generator, built afresh on every call."""
    return DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))


class Loss:
    """Mean squared error that raises ``KeyboardInterrupt`` at its ``at``-th call (then never)."""

    def __init__(self, at: int | None = None) -> None:
        self.calls, self.at = 0, at

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            self.at = None
            raise KeyboardInterrupt
        return nn.functional.mse_loss(model(batch[0]), batch[1])


def runner(loss: Loss, checkpoint_dir=None, **options) -> autobatch.Runner:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1)).double()
    return autobatch.Runner(model, torch.optim.Adam(model.parameters(), lr=0.01), loss, global_batch=8, progress=False,
                            log_every=None, checkpoint_dir=checkpoint_dir, **options)


def planned(loss: Loss, checkpoint_dir=None) -> autobatch.Runner:
    """A runner that plans its micro-batch with real trials only (an estimate's fake-tensor trace
    puts the loss object's attributes back when it ends, an interrupt too)."""
    return runner(loss, checkpoint_dir, plan_options={"strategy": "binary"})


def weights(run: autobatch.Runner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_interrupt_while_planning_saves_a_checkpoint_that_resumes_and_a_fit_that_goes_on(tmp_path):
    with autobatch.simulated_memory("64MiB"):
        torch.manual_seed(42)
        uninterrupted = planned(Loss())
        uninterrupted.fit(loader(), epochs=2)
        for how in ("resume", "second fit"):
            torch.manual_seed(42)
            stopped = planned(Loss(at=2), tmp_path / how)  # in the plan's first trial
            with pytest.raises(KeyboardInterrupt):
                stopped.fit(loader(), epochs=2)
            assert (stopped.micro_batch, stopped.step) == (None, 0)
            if how == "resume":
                stopped.save()
                torch.manual_seed(7)
                stopped = planned(Loss())
                stopped.fit(loader(), epochs=2, resume=tmp_path / how)
            else:
                stopped.fit(loader(), epochs=2)
            assert stopped.result.steps == 6 and stopped.micro_batch == uninterrupted.micro_batch
            assert_same(weights(stopped), weights(uninterrupted))


def test_a_checkpoint_without_a_micro_batch_resumes_at_the_one_given(tmp_path):
    """A checkpoint saved before its run's first plan: the resumed runner's own micro_batch stands."""
    with autobatch.simulated_memory("64MiB"):
        stopped = planned(Loss(at=1), tmp_path)
        with pytest.raises(KeyboardInterrupt):
            stopped.fit(loader())
        stopped.save()
    resumed = runner(Loss(), micro_batch=3)
    resumed.fit(loader(), resume=tmp_path)
    assert (resumed.micro_batch, resumed.result.steps) == (3, 3)


@pytest.mark.parametrize("stop", ["steps", "interrupt"])
def test_a_second_fit_on_a_new_loader_built_alike_goes_on_in_the_uninterrupted_order(stop):
    torch.manual_seed(42)
    uninterrupted = runner(Loss(), micro_batch=3)
    uninterrupted.fit(loader(), epochs=3)
    torch.manual_seed(42)
    stopped = runner(Loss(at=None if stop == "steps" else 5), micro_batch=3)  # step 1's second micro-batch
    if stop == "steps":
        stopped.fit(loader(), steps=1)
    else:
        with pytest.raises(KeyboardInterrupt):
            stopped.fit(loader(), epochs=3)
    assert stopped.step == 1
    stopped.fit(loader(), epochs=3)
    assert stopped.result.steps == 9
    assert_same(weights(stopped), weights(uninterrupted))
