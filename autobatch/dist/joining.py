"""Joining the launcher's process group, and leaving it when the process exits.

``torchrun`` (or Hydra's submitit launcher) starts the ranks with ``RANK``, ``WORLD_SIZE`` and
``MASTER_ADDR`` set; :func:`init_from_env` makes the default group from them (NCCL on CUDA,
gloo on the CPU) and, under NCCL, the gloo group the sync points run on
(:func:`~autobatch.dist.agreement.control_group`). Public as
``autobatch.distributed.init_from_env``; the CLI calls it first thing in a task.
"""

from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist

from .agreement import control_group, is_distributed, log, rank, timeout, world_size

__all__ = ["init_from_env"]


def init_from_env(device_type: str = "auto") -> bool:
    """Join the process group a launcher such as ``torchrun`` describes in the environment.

    With ``WORLD_SIZE`` > 1 and no process group yet: picks NCCL when this rank runs on CUDA
    (``device_type`` ``cuda``, or ``auto`` with CUDA available; the rank's GPU is
    ``LOCAL_RANK``) and gloo otherwise, and initialises the default group. Returns whether this
    process is now distributed.

    Under submitit (Hydra's SLURM launcher) with several tasks, the torch variables are
    exported from SLURM's first (``submitit.helpers.TorchDistributedEnvironment``).

    A group made here is destroyed when the process exits (:func:`_leave_at_exit`): left to
    the interpreter's teardown, gloo aborted the process (``terminate called without an
    active exception``, SIGABRT) in 8 of 16 two-rank runs on the CPU, so torchrun reported a
    finished run as failed; destroyed before the teardown, 0 of 106 (30 of them through
    ``atexit``, as here).
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
        control_group()  # the gloo group for sync points, while every rank is here
    else:
        dist.init_process_group(backend="gloo", timeout=deadline)
    atexit.register(_leave_at_exit)
    backend = dist.get_backend()
    log.info("joined the process group: rank %d of %d (%s)", rank(), world_size(), backend)
    return is_distributed()


def _leave_at_exit() -> None:
    """Destroy the process group :func:`init_from_env` made, before the interpreter's teardown
    (every group, the gloo control group too). Runs once, at exit; a user who destroyed the
    group already is left alone."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
