"""The CLI under ``torchrun``: join the process group, and let only rank 0 report and write.

``torchrun --nproc-per-node N -m autobatch probe|train ...`` starts N copies of the CLI with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set. :func:`join` (called first thing in a task)
initialises the process group, NCCL on CUDA (each rank on GPU ``LOCAL_RANK``), gloo on the
CPU, so the probe and the runner agree across ranks (:mod:`autobatch.distributed`). Ranks
other than 0 print nothing and write nothing into the run directory: the dispatcher gives
their Hydra :func:`hydra_overrides` (no ``.hydra/`` config copy, log lines to the console
only, marked with the rank), and the commands write results on rank 0 only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

import torch

from ..dist.agreement import exchange, is_distributed, is_rank_zero
from ..dist.joining import init_from_env
from ..training.ranks import exchange_bytes, unwrap

__all__ = ["join", "is_rank_zero", "launched_rank", "hydra_overrides", "shared_run_dir", "data_parallel", "unwrapped"]


def join(cfg: DictConfig) -> bool:
    """Join the launcher's process group if there is one; silence stdout on ranks > 0.
    Returns whether this process is distributed."""
    kind = getattr(cfg.device.type, "name", None) or str(cfg.device.type)
    joined = init_from_env(kind)
    if joined and not is_rank_zero():
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    return joined


def shared_run_dir(out_dir: Path) -> Path:
    """Rank 0's run directory, on every rank (one sync point; ``out_dir`` without a process group).

    Each rank's Hydra picks its own run directory, and the default one is a timestamp that
    can differ by a second between ranks. Whatever a rank other than 0 must write (its shards
    of an FSDP2 checkpoint) goes into rank 0's directory instead, and its own directory, which
    Hydra created empty, is removed."""
    if not is_distributed():
        return out_dir
    mine = str(Path(out_dir).resolve()).encode()
    shared = Path(exchange_bytes(exchange, mine, "cli: run directory")[0].decode())
    if not is_rank_zero() and shared != Path(out_dir).resolve():
        try:
            Path(out_dir).rmdir()  # empty: no config copy, no log file on ranks > 0
        except OSError:
            pass  # not empty (something of the user's) or already gone: left as it is
    return shared


def launched_rank() -> int:
    """This process's rank as a launcher such as ``torchrun`` sets it (``RANK`` with
    ``WORLD_SIZE`` > 1), before any process group exists; 0 otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return 0
    return int(os.environ.get("RANK", "0") or 0)


def hydra_overrides(args: Sequence[str]) -> list[str]:
    """Hydra overrides that keep a rank other than 0 out of the run directory: no ``.hydra/``
    copy of the config and no log file (``hydra/job_logging=rank``: the console, lines marked
    with the rank), unless ``args`` choose their own logging. Nothing for rank 0."""
    if launched_rank() == 0:
        return []
    extra = ["hydra.output_subdir=null"]
    if not any(arg.lstrip("+~").startswith("hydra/job_logging") for arg in args):
        extra.append("hydra/job_logging=rank")
    return extra


def data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` wrapped in DDP when this process is one rank of several (else ``model``):
    the runner then trains through DDP's own reducer and the probe measures the DDP step
    (:mod:`autobatch.dist.ddp_step`). DDP's defaults: buffers broadcast from rank 0 at each
    step's start, 25 MiB buckets."""
    if not is_distributed():
        return model
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside :func:`data_parallel`'s wrapper (what ``final_model.pt`` holds)."""
    return unwrap(model)
