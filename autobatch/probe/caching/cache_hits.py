"""Whether a cached answer still holds where the key says it does: memory held beside the step.

The key holds the device, its capacity (on an accelerator what the driver has free plus what this
process reserved, so another process's memory changes it) and the cap, not what this process
holds outside the step when it asks: another model kept on the device, an evaluation copy,
tensors made inside a :func:`~autobatch.simulated_memory` block. Those take the room the answer
was measured with, and a hit handed back the answer of an emptier device: under a 64 MiB
simulated budget a cached 2195 came back with 24 MiB held beside the step, where a probe then
answers 1250 (a hand loop at 2195 runs out of memory).

The cached result's passing trials recorded what was allocated as their last step began
(``resident_bytes``: the weights, the optimizer's state, whatever else was held) and their peak.
A hit is taken only where the answer's trial would still pass with what is allocated beyond
that resident state now on top of its peak: within the capacity, less the allocator headroom
its trials kept on an accelerator. A new process holds less (no optimizer state yet) and hits;
a fuller one probes again, with a note saying why, and its answer is not stored: the entry
keeps the answer for the step alone, which the next call with that memory freed takes.
"""

from __future__ import annotations

from ...memory.units import format_bytes
from ..result import ProbeResult

__all__ = ["held_beside"]


def held_beside(result: ProbeResult, allocated: int, capacity: int, headroom: float) -> str | None:
    """Why the cached ``result`` does not hold with ``allocated`` bytes in use now on a device of
    ``capacity`` whose passing trials keep ``headroom`` (a fraction of it) free: a note for the
    probe that runs instead; None where it holds, or where its answer's trials recorded no
    resident state or peak (a cache written by an older version)."""
    answer = [trial for trial in result.trials if trial.passed and trial.batch_size == result.batch_size
              and trial.resident_bytes is not None and trial.peak_bytes is not None]
    if not answer:
        return None
    extra = allocated - max(trial.resident_bytes for trial in answer)
    room = int(capacity * (1 - headroom)) - max(trial.peak_bytes for trial in answer)
    if extra <= max(room, 0):
        return None
    return (f"not taken from the probe cache: {format_bytes(extra)} more is allocated now than when its answer "
            f"({result.batch_size}) was measured, {format_bytes(max(room, 0))} of room beside its peak (another model "
            "or tensors kept on the device beside the step); probed again")
