"""Models whose forward runs collectives of its own, which autobatch cannot pair.

autobatch keeps the ranks in step by entering every collective it makes on every rank or on
none (:mod:`autobatch.dist.step`). A ``torch.nn.SyncBatchNorm`` all-gathers its statistics
inside the forward, on the process group autobatch votes on: a rank that runs out of memory
before or inside that forward leaves the others waiting in the all-gather, or pairs their
gather with its own vote, and neither a probe trial nor the runner's replay can recover it
(the other ranks wait until the process group's timeout, or fail there). Such models are
warned about once, at the probe's or the runner's start under ``torch.distributed``.
"""

from __future__ import annotations

import logging
import weakref

import torch

__all__ = ["warn_forward_collectives"]

log = logging.getLogger("autobatch")
_WARNED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def warn_forward_collectives(model: torch.nn.Module) -> None:
    """A warning, once per model, where ``model`` holds a ``torch.nn.SyncBatchNorm`` (module
    docstring): which module, why an OOM in it is not replayed, and what to change."""
    if model in _WARNED:
        return
    names = [name or type(module).__name__ for name, module in model.named_modules()
             if isinstance(module, torch.nn.SyncBatchNorm)]
    if not names:
        return
    _WARNED.add(model)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    log.warning(
        "%s %s SyncBatchNorm, whose forward all-gathers across ranks: an out-of-memory error on one rank "
        "inside it cannot be replayed (the other ranks wait in that collective until the process group's "
        "timeout), so autobatch's probe trials and OOM replay are not safe here; use BatchNorm (per-rank "
        "statistics, as DDP keeps them without SyncBatchNorm) to have them, or train at a fixed micro_batch "
        "well under the memory limit", shown, "is a" if len(names) == 1 else "are",
    )
