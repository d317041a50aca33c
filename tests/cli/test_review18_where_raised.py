"""Where the command line says a run-time error was raised, on the CPU's simulated device.

Every op there passes through the simulated device's dispatch mode (``autobatch.memory``), so an
error torch raised for the CLI's own loss (a label out of the model's range of classes) was
"raised at .../autobatch/memory/accounting.py:106, in __torch_dispatch__": a file of autobatch's
accounting that a user would read for the bug. It names the step that called the loss, as on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from autobatch import TrainStep, simulated_memory
from autobatch.cli.build import cross_entropy_loss
from autobatch.cli.errors import where_raised


def test_an_error_of_the_clis_loss_is_not_placed_in_the_simulated_devices_dispatch_mode():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)  # two classes; the labels say 5
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss,
                     lambda n: (torch.randn(n, 4), torch.full((n,), 5)))
    raised = None
    with simulated_memory("8MiB"):
        try:
            step(2)
        except IndexError as exc:
            raised = exc
    assert raised is not None
    raised.__traceback__ = raised.__traceback__.tb_next  # as the CLI's handler sees it: no frame of the user's
    where = where_raised(raised)
    assert "accounting.py" not in where and "train_step.py" in where, where
