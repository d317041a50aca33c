"""The optimizer state a resume loaded, moved onto the CPU's simulated device.

Moved out of :mod:`~autobatch.training.checkpoints.resume` (at its size limit) as it is: one step
of a resume, about where the loaded state is counted, not about what a checkpoint holds.
"""

from __future__ import annotations

import torch

from ...memory.simulated import to_simulated_device

__all__ = ["state_onto_device"]


def state_onto_device(optimizer: torch.optim.Optimizer) -> None:
    """On the CPU's simulated device, the optimizer state just loaded from host memory is copied
    onto the device, as ``load_state_dict`` copies host tensors to a GPU's parameters' device
    (there ``to`` is a no-op on the CPU, so the budget never counted the state); a value of its own
    that a custom optimizer keeps at the state's top level (``self.state["count"] = tensor``), not
    a dict of a parameter, is moved as it is (it failed "'Tensor' object has no attribute 'items'"
    after the weights were loaded, refusing the resume). Measured: a CLI
    run resumed under the 2 MiB its probe was given counted the checkpoint's random states and
    none of the state, and failed its first step at an answer that trained before. A no-op
    without a simulated device."""
    for owner, state in list(optimizer.state.items()):
        if type(state) is torch.Tensor and state.dim() > 0:  # a custom optimizer's own tensor (state["count"] = ...)
            optimizer.state[owner] = to_simulated_device(state)
        elif isinstance(state, dict):  # a parameter's state; anything else (a number, a list) is kept as loaded
            for key, value in state.items():
                if type(value) is torch.Tensor and value.dim() > 0:
                    state[key] = to_simulated_device(value)
