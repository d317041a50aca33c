"""Rewind the random generators a global step draws from, so a replay draws the same numbers.

Why it is needed. Forward draws from torch's generators (dropout masks, ``torch.rand`` in a
loss). An attempt that runs out of memory part-way has already advanced them, so a replay
that does not rewind them draws other masks than the run that never failed, and every later
step differs too: a small MLP with dropout ended 0.08 away from the uninjected run's weights,
5.6e-17 with the generators rewound. A step abandoned or interrupted (``KeyboardInterrupt``)
is likewise rewound, so a checkpoint saved after it holds the random state of the step's
start, and the resumed run draws what the uninterrupted one did.

What it covers: torch's CPU generator and the generator of the runner's accelerator (CUDA,
XPU, MPS: the device the model trains on), the ones torch operations inside a step draw from.
Python's ``random`` and NumPy's global generator are not rewound (reading them costs ~60 us
a step, 40 times the rest); a ``loss_fn`` that draws from them replays with other numbers, so
draw from torch inside a step. A data loader's generators are drawn before the step, not in it.

On CUDA the masks also depend on how the batch is split: dropout's Philox counter numbers
the elements of each kernel call, so micro-batches of 4 draw other masks than one of 8 (an H200,
no fault: 0.11 apart after 12 steps). A replay at a smaller micro-batch therefore ends as a run
that used that split from the step's start, not bit-equal to one that never split; a replay at
the same split (a failed grow-back try) is bit-equal. On the CPU the masks do not depend on it.

Cost per global step: a host copy of the CPU generator's state (5 KiB) and of the accelerator's
seed and offset (16 bytes on CUDA, read on the host: no device sync): ~3 us on the CPU, ~4 us
with CUDA (an H200).
"""

from __future__ import annotations

from typing import Any

import torch

from ...memory.simulated import host_memory

__all__ = ["StepRandom"]


class StepRandom:
    """The random state at the start of the current global step, on ``device``'s generators."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._module = _accelerator(self.device)
        self._state: tuple[torch.Tensor, Any] | None = None

    def capture(self) -> None:
        """Read the generators' states (at the start of every global step)."""
        with host_memory():  # a simulated device's budget must not count the copy
            accelerator = None if self._module is None else self._module.get_rng_state(self.device)
            self._state = (torch.get_rng_state(), accelerator)

    def restore(self) -> None:
        """Put the states of the last :meth:`capture` back (a replay, an abandoned step)."""
        if self._state is None:
            return
        cpu, accelerator = self._state
        torch.set_rng_state(cpu)
        if accelerator is not None:
            self._module.set_rng_state(accelerator, self.device)


def _accelerator(device: torch.device) -> Any:
    """The torch module holding ``device``'s generator (``torch.cuda``...), None for the CPU."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    if module is None or not callable(getattr(module, "get_rng_state", None)):
        return None
    return module
