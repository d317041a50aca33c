"""The CLI under ``torchrun``: join the process group, and let only rank 0 report.

``torchrun --nproc-per-node N -m autobatch probe ...`` starts N copies of the CLI with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set. :func:`join` (called first thing in a task)
initialises the process group, NCCL on CUDA (each rank on GPU ``LOCAL_RANK``), gloo on the
CPU, so the probe and the runner agree across ranks (:mod:`autobatch.distributed`). Ranks
other than 0 print nothing (their log lines still go to the log) and write no result file.
"""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig

from ..distributed import init_from_env, is_rank_zero

__all__ = ["join", "is_rank_zero"]


def join(cfg: DictConfig) -> bool:
    """Join the launcher's process group if there is one; silence stdout on ranks > 0.
    Returns whether this process is distributed."""
    kind = getattr(cfg.device.type, "name", None) or str(cfg.device.type)
    joined = init_from_env(kind)
    if joined and not is_rank_zero():
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    return joined
