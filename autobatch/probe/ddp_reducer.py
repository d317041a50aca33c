"""A ``DistributedDataParallel`` reducer after a step that failed, and its bucket rebuilds.

DDP all-reduces gradients in flat *buckets*, one set of them the size of every gradient. It
builds them once in the parameters' order and rebuilds them, once, in the order the first
backward made the gradients ready, in the forward after that backward
(``reducer._rebuild_buckets()``). Its ``reducer._reset_state()``, the recovery after a backward
that failed part-way, asks for that rebuild again. A rebuild allocates the new buckets before it
frees the old, and the allocator's cache then holds the old ones' blocks in pieces a step's large
activations may not reuse. Measured on an H100 (an 8-block MLP of width 1024/4096 under
``torchrun --nproc-per-node 1``, AdamW, 2 GiB cap, its gradients 256 MiB;
``.whl/diag/ddp_rebuild.py``, see ``docs/distributed.md``): the step of the rebuild at batch 2000
peaked at 1993 MiB where the steps after it peaked at 1737; after one OOM and a reset, every
later step of 2000 ran out of memory, its start 256 MiB higher each time, while the same steps
passed at 1733 MiB once the reset was followed by a rebuild between steps. The probe answered
a quarter below the batch the model trains at, and the Runner shrank its micro-batch step
after step.

So the rebuild runs between steps, where only the resident state is allocated:

* :func:`reset_failed_reduction` (a one-process group) resets and rebuilds at once, in the
  parameters' order (``_push_all_rebuilt_params``; with one rank no communication overlaps
  backward, so the order costs nothing);
* :func:`rebuild_between_steps` rebuilds one a backward asked for, after a step that trained:
  DDP's first rebuild, and with more ranks the one every rank's reset asked for (in the order of
  the backward just run, as DDP would; it is a collective, called by every rank at the same
  point after a step every rank completed).
"""

from __future__ import annotations

import torch

__all__ = ["ddp_wrapper", "reset_failed_reduction", "rebuild_between_steps"]


def ddp_wrapper(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """``model`` where it is a DDP wrapper, itself or inside ``torch.compile``'s
    (``torch.compile(DDP(...))``); else None."""
    wrapper = getattr(model, "_orig_mod", model)
    return wrapper if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) else None


def reset_failed_reduction(model: torch.nn.Module) -> None:
    """Put a ``DistributedDataParallel`` model of a one-process group (``torchrun
    --nproc-per-node 1``, a DDP script run on one GPU) back to no reduction in flight, after a
    step that failed part-way, and rebuild its buckets now (module docstring): an out-of-memory
    error inside backward left DDP's reducer expecting the rest of that backward, and every later
    forward raised "Expected to have finished reduction in the prior iteration" (the probe
    stopped at its first OOM trial; the Runner shrank the micro-batch down to one that "could not
    train"). With more ranks the ranks' vote resets it together
    (:func:`autobatch.dist.ddp_step.reset_after_failure`)."""
    wrapper = ddp_wrapper(model)
    if wrapper is None or torch.distributed.get_world_size(wrapper.process_group) != 1:
        return
    wrapper.reducer._reset_state()
    wrapper.reducer._push_all_rebuilt_params()  # nothing where DDP never rebuilds (find_unused_parameters)
    _rebuild(wrapper)


def rebuild_between_steps(model: torch.nn.Module) -> bool:
    """Rebuild a DDP model's buckets where a backward asked for it (module docstring), after a
    step that trained, instead of in the next forward; True where it did. Nothing where none is
    pending (one C++ check), so it is called after every step. With more than one rank every rank
    calls it at the same point: the rebuild agrees the buckets over the process group."""
    wrapper = ddp_wrapper(model)
    return wrapper is not None and _rebuild(wrapper)


def _rebuild(wrapper: torch.nn.parallel.DistributedDataParallel) -> bool:
    """DDP's own rebuild, and its flag that it happened (read by its ZeRO hook)."""
    if not wrapper.reducer._rebuild_buckets():
        return False
    wrapper._has_rebuilt_buckets = True
    return True
