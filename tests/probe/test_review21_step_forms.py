"""Step forms of review 21: tensors a fake-tensor trace writes in place, torch's own loss function.

Under ``FakeTensorMode`` an operator whose inputs are all real runs for real, so a forward that
updates a tensor kept as a plain attribute (an EMA copy of the weights, a step counter) wrote the
user's tensor at every trace: ``strategy="estimate"`` left the EMA 12 updates on and the counter
at 12, and the cache key's fake batches advanced a counter ``make_batch`` keeps. And
``TrainStep(model, optimizer, F.cross_entropy, make_batch)`` was built, then its first trial raised
torch's bare "argument 'input' (position 1) must be Tensor, not Sequential".
"""

import pytest
import torch

import autobatch
from autobatch.probe.caching.key_batches import sample_batches


class _Ema(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.ema = self.lin.weight.detach().clone()  # plain attributes, not buffers
        self.updates = torch.zeros(())

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.5)
            self.updates.add_(1)
        return self.lin(x)


def test_an_estimate_leaves_tensors_forward_and_make_batch_write_as_they_were():
    model, drawn = _Ema(), torch.zeros((), dtype=torch.long)

    def make_batch(n):
        drawn.add_(n)  # a real tensor written with real inputs: runs for real under the fake mode
        return torch.randn(n, 8)

    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), make_batch)
    ema = model.ema.clone()
    result = autobatch.find_max_batch(step, memory_limit="64KiB", strategy="estimate")
    sample_batches(make_batch)
    assert result.batch_size > 1 and not result.tested
    assert torch.equal(model.ema, ema) and model.updates.item() == 0 and drawn.item() == 0


def test_torchs_own_loss_function_as_loss_fn_is_refused_with_the_wrapper_to_write():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"lambda model, batch: torch.nn.functional.cross_entropy\(model\(batch\[0\]\)"):
        autobatch.TrainStep(model, optimizer, torch.nn.functional.cross_entropy, lambda n: torch.randn(n, 8))
