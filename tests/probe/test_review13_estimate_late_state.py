"""An optimizer that makes its buffers on its second step: the estimate must count them under the
next step's activations, as a trial's third step does (review 13)."""

from __future__ import annotations

import torch

import autobatch
from autobatch.probe.tracing.estimate import estimate_memory


class LateBuffers(torch.optim.Optimizer):
    """SGD that keeps a buffer of four copies of each parameter from its second step on
    (as optimizers whose preconditioners start after a first step do)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] >= 2:
                    state.setdefault("buf", torch.zeros(4, *p.shape)).mul_(0.9).add_(p.grad)
                p.add_(p.grad, alpha=-group["lr"])


def _step() -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return autobatch.TrainStep(
        model, LateBuffers(model.parameters()),
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))),
    )


def _measured_peak(steps: int, batch_size: int) -> int:
    step = _step()
    with autobatch.simulated_memory("1GiB") as device:
        for _ in range(steps):
            step(batch_size)
        return device.peak_bytes


def test_state_made_on_the_second_step_is_under_the_third_steps_peak():
    estimated = estimate_memory(_step(), 64).step_peak_bytes
    assert estimated == _measured_peak(3, 64) > _measured_peak(2, 64)


def test_the_estimate_strategy_answers_what_the_trials_answer():
    limit = _measured_peak(3, 200)
    trials = autobatch.find_max_batch(_step(), memory_limit=limit, cache=False, strategy="binary")
    estimated = autobatch.find_max_batch(_step(), memory_limit=limit, cache=False, strategy="estimate")
    assert estimated.batch_size == trials.batch_size == 200
