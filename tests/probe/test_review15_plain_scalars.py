"""The probe puts back the plain scalar attributes forward changes on a module of the user's own:
a step counter, an annealed temperature, and a data-dependent initialisation's flag (Glow's
ActNorm), which left True would make training skip that initialisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, find_max_batch


class ActNorm(torch.nn.Module):
    """Initialises its affine parameters from the first batch it sees (a plain bool flag)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.loc = torch.nn.Parameter(torch.zeros(width))
        self.initialized = False
        self.steps, self.temperature = 0, 1.0

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
            self.initialized = True
        if not hasattr(self, "first_width"):
            self.first_width = x.shape[1]
        self.steps += 1
        self.temperature *= 0.5
        return x + self.loc


@pytest.mark.filterwarnings("ignore:the probe's trials wrote 1.loc")  # at learning rate 0: not copied
def test_scalars_forward_changed_are_put_back():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), ActNorm(64), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen: list[bool] = []

    def loss_fn(m, batch):
        seen.append(m[1].initialized)  # as each step begins
        return F.cross_entropy(m(batch[0]), batch[1])

    step = TrainStep(model, optimizer, loss_fn, lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))
    result = find_max_batch(step, memory_limit="256KiB", cache=False, estimate_first=False)
    assert result.batch_size > 1 and len(seen) > 3
    norm = model[1]
    assert (norm.initialized, norm.steps, norm.temperature) == (False, 0, 1.0)
    assert "first_width" not in vars(norm)
    assert seen[0] is False and seen[1] is True  # a trial's steps keep what the earlier ones set
