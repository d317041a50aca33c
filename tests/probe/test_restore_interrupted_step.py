"""A trial that runs out of memory inside ``optimizer.step()`` at learning rate 0.

The snapshot copies no weight then, and names a parameter whose version counter moved outside
the optimizer's steps (something else wrote it, and the probe could not put it back). A step
that raised runs no post-hook, so its own writes were counted as outside ones: a warning said
the trials "wrote 0.weight ... outside optimizer.step()" although every weight was unchanged.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import autobatch
from autobatch.probe.snapshot.restore import Snapshot


class OutOfMemoryAtWrite(TorchFunctionMode):
    """Raise ``torch.OutOfMemoryError`` at the ``at``-th ``addcdiv_`` (AdamW's update of one
    parameter), after the step has written the parameters before it."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.seen = at, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.addcdiv_:
            self.seen += 1
            if self.seen == self.at:
                raise torch.OutOfMemoryError("injected: out of memory inside optimizer.step()")
        return func(*args, **(kwargs or {}))


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def interrupted_trial(model, optimizer, write_outside: bool) -> None:
    if write_outside:  # a loss that clamps a weight the optimizer holds
        with torch.no_grad():
            model[2].weight.clamp_(-0.1, 0.1)
    model(torch.randn(3, 4)).square().mean().backward()
    with OutOfMemoryAtWrite(at=3), pytest.raises(torch.OutOfMemoryError):
        optimizer.step()


@pytest.mark.parametrize("write_outside", [False, True])
def test_an_interrupted_step_is_not_blamed_on_the_forward(write_outside):
    model, optimizer = model_and_optimizer()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    snapshot = Snapshot.take(model, optimizer, zero_lr=True)
    assert snapshot.weights_in_place
    interrupted_trial(model, optimizer, write_outside)
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # a later trial's step completes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snapshot.restore()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if write_outside:
        assert len(said) == 1 and "wrote 2.weight outside optimizer.step()" in said[0]
    else:
        assert not said
        assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_last_trial_interrupted_in_the_step_leaves_no_false_warning():
    """The probe ends right after the interrupted step (nothing fits): the window it left open
    is closed when the snapshot is restored."""
    model, optimizer = model_and_optimizer()
    snapshot = Snapshot.take(model, optimizer, zero_lr=True)
    interrupted_trial(model, optimizer, write_outside=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        snapshot.restore()


def test_a_probe_whose_trials_run_out_of_memory_in_adamw_step_does_not_warn():
    """The adversarial report: AdamW, 4 MiB simulated; batch 1 runs out of memory in the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    step = autobatch.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(autobatch.NoBatchFitsError):
            autobatch.find_max_batch(step, memory_limit="4MiB", strategy="binary", cache=False)
    assert not [w for w in caught if "outside optimizer.step" in str(w.message)]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_optimizer_accelerate_prepared_is_probed_and_restored():
    """Accelerate's AcceleratedOptimizer never ran Optimizer.__init__ and has no step hooks of
    its own: the snapshot hooks the optimizer it wraps (which its step runs), so a TrainStep over
    a prepared model and optimizer (a Trainer that already trained) probes and comes back exact."""
    accelerate = pytest.importorskip("accelerate")
    import autobatch

    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    step = autobatch.TrainStep(model, optimizer, loss_fn, lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,))))
    result = autobatch.find_max_batch(step, memory_limit="2MiB", cache=False)
    assert result.batch_size > 1 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(optimizer.state.values())
