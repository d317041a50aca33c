"""Under torch.distributed the CLI's first Ctrl-C (or SIGTERM) asks the runner to stop after the
step in progress; the request now carries the signal's name, so the run's ``result.stop_reason``
says "SIGINT" where it said only "request_stop()"."""

from __future__ import annotations

import signal

import torch

import autobatch
from autobatch.cli.interrupt import Interrupts


def test_a_deferred_signal_names_itself_as_the_runs_stop_reason():
    model = torch.nn.Linear(4, 1)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: m(b).pow(2).mean(), micro_batch=2, global_batch=2, device="cpu")
    interrupts = Interrupts(defer=runner.request_stop)
    with interrupts:
        interrupts._handle(signal.SIGINT, None)  # as the signal would, without sending one to the test process
    result = runner.fit([torch.randn(2, 4) for _ in range(3)], epochs=1)
    assert result.stopped and result.stop_reason == "SIGINT" and result.steps == 1
