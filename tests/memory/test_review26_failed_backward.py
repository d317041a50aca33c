"""A backward that runs out of memory part-way leaves the tasks it had queued on the calling
thread's autograd ready queue, each holding its node and so the graph upstream of it, until the
thread's next backward: no reference a caller can drop, and no ``gc.collect()``, frees them.
``free_memory()`` drains the engine first. Before, a two-branch model kept 17 KiB of a 49 KiB
budget after its failed backward, and the runner sized its replay on that (a routed
mixture-of-experts step replayed at 22 where 56 fits)."""

from __future__ import annotations

import gc

import torch
from torch import nn

import autobatch
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.memory.oom import free_memory
from autobatch.memory.simulated import active_simulation


class Branches(nn.Module):
    """Two branches added: the backward queues one branch's task while the other fails."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
        self.b = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x):
        return self.a(x) + self.b(x)


def _failed_backward(model: nn.Module, x: torch.Tensor) -> SimulatedDeviceMemory:
    """Run ``model``'s backward into the active budget's wall; the memory, every reference dropped."""
    memory = SimulatedDeviceMemory(active_simulation())
    try:
        model(x).pow(2).mean().backward()
    except torch.OutOfMemoryError as exc:
        assert "backward" in str(exc), exc  # the forward fitted: the failure came part-way through backward
    else:
        raise AssertionError("the backward fitted the budget: nothing to check")
    model.zero_grad(set_to_none=True)
    gc.collect()
    return memory


def _made() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Branches(), torch.randn(59, 8)  # made outside the budget: only the step's tensors count


def test_free_memory_frees_what_a_failed_backward_left_queued():
    model, x = _made()
    with autobatch.simulated_memory(50_000):
        memory = _failed_backward(model, x)
        assert memory.allocated() > 0  # the engine's queued tasks: no reference left to drop
        free_memory()
        assert memory.allocated() == 0


def test_free_memory_drains_in_inference_mode_and_without_grad():
    model, x = _made()
    with autobatch.simulated_memory(50_000):
        memory = _failed_backward(model, x)
        with torch.inference_mode(), torch.no_grad():
            free_memory()
        assert memory.allocated() == 0


def test_free_memory_runs_with_the_simulated_budget_full():
    """The drain's one-element tensors are host memory: with the budget full, they ran out of it."""
    with autobatch.simulated_memory(4096) as budget:
        held = torch.empty(4096, dtype=torch.uint8)  # the whole budget, still referenced
        free_memory()
        assert budget.current_bytes == 4096
        del held
