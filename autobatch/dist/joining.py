"""Joining the launcher's process group, and leaving it when the process exits.

``torchrun`` (or Hydra's submitit launcher) starts the ranks with ``RANK``, ``WORLD_SIZE`` and
``MASTER_ADDR`` set; :func:`init_from_env` makes the default group from them (NCCL on CUDA,
gloo on the CPU) and the gloo group the sync points run on (a side group under gloo too)
(:func:`~autobatch.dist.agreement.control_group`). Public as
``autobatch.distributed.init_from_env``; the CLI calls it first thing in a task.

A :class:`~autobatch.Runner` keeps the world it was built in (each rank's share is
``global_batch / world``): :func:`remember_world` records it, and :func:`check_same_world`
refuses a ``fit()`` in another one (the group destroyed between two ``fit()`` calls).
"""

from __future__ import annotations

import atexit
import gc
import os
import weakref

import torch
import torch.distributed as dist

from . import agreement as dist_sync
from .agreement import control_group, is_distributed, log, rank, timeout, world_size

__all__ = ["init_from_env", "remember_world", "check_same_world"]

#: the world size each distributed runner's model was given to a ``Runner`` in (its latest)
_BUILT_IN: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def remember_world(model: torch.nn.Module) -> None:
    """Record the world size a distributed ``Runner(model, ...)`` is built in (at its construction)."""
    _BUILT_IN[model] = dist_sync.world_size()


def check_same_world(model: torch.nn.Module) -> None:
    """Refuse a distributed ``fit()`` in another world than its ``Runner(...)`` was built in.

    Why: the runner fixed each rank's share (``global_batch / world``) and the ranks it votes and
    all-reduces with when it was built. After ``torch.distributed.destroy_process_group()``
    between two ``fit()`` calls, every rank went on alone (no sync point, no all-reduce: a DDP
    model's forward still ran on the destroyed group), trained each of its batches as a whole
    global batch with only a batch-size warning, and the ranks' weights came apart silently.
    The other way round, a ``Runner(distributed=True)`` built before ``init_process_group()``
    keeps a share of the whole global batch. Raised on every rank alike at the start of
    ``fit()``, before its first sync point (one in another world pairs with nothing)."""
    built = _BUILT_IN.get(model)
    now = dist_sync.world_size() if dist_sync.is_distributed() else 1
    if built is None or built == now:
        return
    where = (f"a job of {now} ranks" if now > 1
             else "one process (no process group of several ranks is active: destroy_process_group() was called?)")
    built_in = f"a job of {built} ranks" if built > 1 else "one process (before init_process_group())"
    raise ValueError(
        f"this Runner was built in {built_in} and fit() now runs in {where}; a Runner keeps the "
        f"world it was built in (each rank's share is global_batch / {built}, voted and all-reduced over {built} "
        "ranks). Call fit() before destroy_process_group(), or build a new Runner (wrapping the model in DDP or "
        "fully_shard again) after init_process_group()"
    )


def init_from_env(device_type: str = "auto") -> bool:
    """Join the process group a launcher such as ``torchrun`` describes in the environment.

    With ``WORLD_SIZE`` > 1 and no process group yet: picks NCCL when this rank runs on CUDA
    (``device_type`` ``cuda``, or ``auto`` with CUDA available; the rank's GPU is
    ``LOCAL_RANK``) and gloo otherwise, and initialises the default group. Returns whether this
    process is now distributed.

    Under submitit (Hydra's SLURM launcher) with several tasks, the torch variables are
    exported from SLURM's first (``submitit.helpers.TorchDistributedEnvironment``).

    A group made here is destroyed when the process exits (:func:`_leave_at_exit`), so that
    gloo does not abort a finished run at the interpreter's teardown (details there).
    """
    if "RANK" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR") and int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or not dist.is_available():
        return False
    if dist.is_initialized():
        return is_distributed()
    from datetime import timedelta

    # the default group's own timeout is the sync deadline too: a collective that DDP runs
    # (a bucket all-reduce a gloo rank blocks in) then ends in an error within it, not later
    deadline = timedelta(seconds=timeout())
    on_cuda = torch.cuda.is_available() and device_type in ("cuda", "auto")
    if on_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
        torch.cuda.set_device(device)
        # device_id: NCCL sets up its communicator now, while every rank is here, rather than
        # inside the first collective (a blocking rendezvous that no sync-point deadline covers)
        dist.init_process_group(backend="nccl", device_id=device, timeout=deadline)
    else:
        dist.init_process_group(backend="gloo", timeout=deadline)
    control_group()  # the gloo group for sync points (under gloo too), while every rank is here
    atexit.register(_leave_at_exit)
    backend = dist.get_backend()
    log.info("joined the process group: rank %d of %d (%s)", rank(), world_size(), backend)
    return is_distributed()


def _leave_at_exit() -> None:
    """Destroy the process group :func:`init_from_env` made, and free what still holds it,
    before the interpreter's teardown (every group, the gloo control group too). Runs once,
    at exit; a user who destroyed the group already is left alone.

    Why both: a gloo group freed during the teardown aborts the process (``terminate called
    without an active exception``, SIGABRT), and torchrun then reports a finished run as
    failed. Left to the teardown, 8 of 16 two-rank CPU runs aborted. Destroyed here, the
    group object can still outlive the call, held by garbage such as a DDP model's reducer:
    a two-rank DDP job aborted in 32 of 490 launches (the CLI once in CI; a barrier before
    the destroy, 4 of 80). Collecting that garbage before and after the destroy, 0 of 320
    (``scripts/diag_gloo_exit.py``).
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # garbage (a finished task's DDP model) that holds the group
        dist.destroy_process_group()
        gc.collect()  # the group objects themselves, now only in reference cycles
