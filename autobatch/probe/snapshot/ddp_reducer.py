"""A one-process ``DistributedDataParallel`` reducer after a step that failed.

DDP all-reduces gradients in flat *buckets*, one set of them the size of every gradient. It
builds them in the parameters' order and rebuilds them, once, in the order the first backward
made the gradients ready, in the forward after that backward (``reducer._rebuild_buckets()``).
Its ``reducer._reset_state()``, the recovery after a backward that failed part-way, asks for that
rebuild again, in a later forward; a rebuild allocates the new buckets before the old ones go.
Measured on one GPU (an 8-block MLP of width 1024/4096 under ``torchrun --nproc-per-node 1``,
AdamW, 2 GiB cap, its gradients 256 MiB; ``scripts/diag_ddp_rebuild.py``): steps of 2000 peaked
at 1737 MiB; after one OOM and DDP's reset, every other step of 2000 ran out of memory, starting
256 MiB higher (H100 and H200), and the probe answered 1430 and 522 where its one-step trials had
passed 2565. :func:`reset_failed_reduction` resets only a reduction left in flight (an OOM in
backward; one in forward or in the optimizer leaves none), rebuilds the buckets at once, between
steps, and waits for the old ones to be released (:func:`_await_release`).
:func:`rebuild_before_first_step` makes DDP's own first rebuild before any bucket was
all-reduced, where the old buckets go at once. See
``docs/distributed.md`` (Limits) for the figures after it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["ddp_wrapper", "rebuild_before_first_step", "reset_failed_reduction", "add_reset", "RELEASE_WAIT_S"]

#: the same reset for other wrappers, added by a later stage (:mod:`autobatch.dist`: FSDP2's)
_RESETS: list[Callable[[torch.nn.Module], None]] = []


def add_reset(reset: Callable[[torch.nn.Module], None]) -> None:
    """Have :func:`reset_failed_reduction` also call ``reset(model)``: how :mod:`autobatch.dist`,
    which comes after this stage, puts a one-process ``fully_shard`` model back after a failed step."""
    if reset not in _RESETS:
        _RESETS.append(reset)

#: the longest wait for the old buckets' release after a rebuild on a GPU: released within 1 s
#: where measured, not within 0.25-0.3 s (a rebuild happens after each OOM in backward)
RELEASE_WAIT_S = 1.0
#: what may stay allocated beyond the rebuild's start: the new buckets' rounding, in 512-byte blocks
RELEASE_SLACK = 2**20


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
    train"). The rebuild takes the parameters' order (``_push_all_rebuilt_params``): with one rank
    no communication overlaps backward, so the order costs nothing. With more ranks the ranks'
    vote resets it together (:func:`autobatch.dist.ddp_step.reset_after_failure`). Then the
    resets of :func:`add_reset` (FSDP2's)."""
    for reset in _RESETS:
        reset(model)
    wrapper = ddp_wrapper(model)
    if wrapper is None or torch.distributed.get_world_size(wrapper.process_group) != 1 or not _in_flight(wrapper):
        return  # an OOM in forward or in the optimizer left no reduction behind: no reset, no rebuild
    wrapper.reducer._reset_state()
    wrapper.reducer._push_all_rebuilt_params()  # nothing where DDP never rebuilds (find_unused_parameters)
    device = next((param.device for param in wrapper.parameters()), None)
    cuda = device is not None and device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    if wrapper.reducer._rebuild_buckets():
        wrapper._has_rebuilt_buckets = True  # DDP's own flag that it rebuilt (read by its ZeRO hook)
        if cuda:
            _await_release(device, before)


def rebuild_before_first_step(model: torch.nn.Module) -> None:
    """Make a one-process DDP's first bucket rebuild now, before a step, in the parameters' order,
    where DDP would make it in the forward after its first backward.

    The old buckets had been all-reduced by then, and their release after that rebuild came late
    in some runs (asynchronous: NCCL may hold a collective's tensors until its watchdog sees it
    complete): on an H200 (``scripts/diag_ddp_rebuild.py``, 2 GiB cap, buckets of
    256 MiB) the second step of 2000 peaked at 1993 MiB in some runs, its old buckets still
    allocated, and at 1736 MiB in others. Rebuilt before any collective, the old buckets went at
    once (512 MiB allocated before and after), and the second step peaked at 1737 MiB in both
    runs: a new process that trains at the answer from its first step (a cache hit) no longer
    meets the rebuild on top of its second step. With one rank the order costs nothing (no
    communication overlaps backward); with more, DDP's own rebuild is left alone."""
    wrapper = ddp_wrapper(model)
    if (wrapper is None or getattr(wrapper, "_has_rebuilt_buckets", True) or not torch.is_grad_enabled()
            or not torch.distributed.is_initialized() or torch.distributed.get_world_size(wrapper.process_group) != 1):
        return
    wrapper.reducer._push_all_rebuilt_params()  # nothing where a backward already gave its order
    if wrapper.reducer._rebuild_buckets():  # False where DDP never rebuilds (find_unused_parameters)
        wrapper._has_rebuilt_buckets = True


def _in_flight(wrapper: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether the reducer waits for the rest of a backward (DDP's own check, which raises then)."""
    try:
        wrapper.reducer._check_reducer_finalized()
    except RuntimeError:
        return True
    return False


def _await_release(device: torch.device, before: int) -> None:
    """Wait, at most :data:`RELEASE_WAIT_S`, until what is allocated falls back to ``before``: the
    old buckets, which the failed backward had begun to all-reduce, stayed allocated after the
    rebuild (on an H200, 1345 MiB where 1089 are resident) and the next step of a size that
    trains ran out of memory; waited for, they were gone before it, and every step after passed."""
    torch.cuda.synchronize(device)
    deadline = time.monotonic() + RELEASE_WAIT_S
    while torch.cuda.memory_allocated(device) > before + RELEASE_SLACK and time.monotonic() < deadline:
        time.sleep(0.002)
