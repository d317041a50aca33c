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


class Capturing(torch.nn.Module):
    """Registers a hook on its blocks at its first forward and marks itself so, as Transformers 5's
    output capturing does (``_output_capturing_hooks_installed``): each block's output recorded once."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        self.recorded: list = []

    def forward(self, x):
        if not getattr(self, "_hooks_installed", False):
            for block in self.blocks:
                block.register_forward_hook(lambda module, args, output: self.recorded.append(output.shape))
            self._hooks_installed = True
        self.recorded.clear()
        return self.blocks(x)


def test_review37_hooks_a_forward_registered_go_with_the_flag_that_marks_them():
    """The trials' added flag was removed and their hooks kept: the next forward registered them again and
    every output was recorded twice (a SegFormer's decoder then got the wrong stage's features)."""
    model = Capturing()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).square().mean(),
                     lambda n: torch.randn(n, 8))
    assert find_max_batch(step, memory_limit="256KiB", cache=False, estimate_first=False).batch_size > 1
    model(torch.randn(2, 8))
    assert len(model.recorded) == 2  # each block's output once (4 before)
