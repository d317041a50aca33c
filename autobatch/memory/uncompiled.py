"""``torch.compile``d code run uncompiled under autobatch's dispatch modes, and left compiled after them.

Dynamo does not compile a frame while a ``TorchDispatchMode`` is active (the simulated device of
:func:`~autobatch.memory.simulated.simulated_memory` is one, the estimate's fake-tensor trace another):
it runs the frame eagerly, and marks its code skipped for good. So after a probe on the CPU (its trials
under the simulation, or ``strategy="estimate"``; a ``Runner`` planning its micro-batch) a compiled model
never compiled again in that process: it trained eagerly, and nothing said so (torch 2.13, a counting
backend: one compile for a run without the probe, none after it). And a ``fullgraph=True`` model raised
torch's bare "torch.compile with fullgraph=True found no compiled frames" from the first trial, then from
every later call, outside the probe too. Under ``torch.compiler.set_stance("force_eager")`` dynamo runs
the code eagerly without looking at the frame, so it marks nothing and ``fullgraph`` forbids nothing; the
answer is the eager step's, as the notes say (:func:`~autobatch.probe.arguments.simulated_compile_note`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

__all__ = ["uncompiled"]


@contextmanager
def uncompiled() -> Iterator[None]:
    """Run ``torch.compile``d code eagerly inside the block, leaving it to compile after it. Nothing (and no
    import of dynamo, which takes seconds) where nothing in this process imported the compiler. The stance is
    process-wide, as torch keeps it: another thread's compiled code runs eagerly while the block is open."""
    if "torch._dynamo" not in sys.modules:
        yield
        return
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield
