"""Where the command line says a run-time error was raised, on the CPU's simulated device.

Every op there passes through the simulated device's dispatch mode (``autobatch.memory``), so an
error torch raised for the CLI's own loss (a label out of the model's range of classes) was
"raised at .../autobatch/memory/accounting.py:106, in __torch_dispatch__": a file of autobatch's
accounting that a user would read for the bug. It names the step that called the loss, as on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import TrainStep, simulated_memory
from autobatch.cli.build import cross_entropy_loss
from autobatch.cli.errors import where_raised


def _users_loss(model, batch):
    return nn.functional.nll_loss(model(batch[0]), batch[1])  # torch raises inside the dispatch mode here


def _raised(loss_fn) -> BaseException:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)  # two classes; the labels say 5
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                     lambda n: (torch.randn(n, 4), torch.full((n,), 5)))
    with simulated_memory("8MiB"), pytest.raises(Exception) as caught:
        step(2)
    raised = caught.value
    raised.__traceback__ = raised.__traceback__.tb_next  # as the CLI's handler sees it: no frame of the test's
    return raised


def test_a_torch_error_under_the_simulated_device_is_placed_in_the_loss_not_its_dispatch_mode():
    where = where_raised(_raised(_users_loss))
    assert "accounting.py" not in where and "test_review18_where_raised.py" in where, where


def test_the_clis_loss_names_a_target_out_of_range_in_its_own_words():
    raised = _raised(cross_entropy_loss)  # its own error now, naming data.num_classes: no place to add
    assert isinstance(raised, ValueError) and "data.num_classes=2" in str(raised) and where_raised(raised) == ""
