"""The training run behind ``python -m autobatch train``: a plain loop at a fixed batch size.

:func:`run_training` is the seam where autobatch's resilient runner (OOM recovery, gradient
accumulation) will plug in; until then it trains forward/backward/step at the batch it is
given, writing one JSON line of metrics per step and optional checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from .build import Workload, cross_entropy_loss

__all__ = ["total_steps", "run_training"]

log = logging.getLogger("autobatch")


def total_steps(cfg: DictConfig, batch_size: int, samples_per_epoch: int) -> int:
    """``train.steps``, or with ``train.epochs`` that many passes over the data."""
    if cfg.train.epochs is not None:
        return cfg.train.epochs * math.ceil(samples_per_epoch / batch_size)
    return int(cfg.train.steps)


def _save_checkpoint(directory: Path, step: int, workload: Workload) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    torch.save({"step": step, "model": workload.model.state_dict(), "optimizer": workload.optimizer.state_dict()}, path)
    return path


def run_training(cfg: DictConfig, workload: Workload, batch_size: int, out_dir: Path) -> dict[str, Any]:
    """Train ``workload`` at ``batch_size`` for :func:`total_steps`; write ``metrics.jsonl``
    (and checkpoints) under ``out_dir``; return a summary for ``train_result.json``."""
    steps = total_steps(cfg, batch_size, workload.samples_per_epoch)
    every = int(cfg.train.checkpoint_every)
    checkpoint_dir = out_dir / cfg.train.checkpoint_dir
    device = workload.device
    autocast = (
        torch.autocast(device.type, dtype=workload.autocast_dtype) if workload.autocast_dtype else nullcontext()
    )
    log_every = max(1, steps // 10)
    model, optimizer, scaler = workload.model, workload.optimizer, workload.grad_scaler
    model.train()
    began = time.perf_counter()
    losses: list[float] = []
    checkpoints: list[str] = []
    with open(out_dir / "metrics.jsonl", "w", encoding="utf-8") as metrics:
        for step in range(1, steps + 1):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batch = workload.make_batch(batch_size)
            with autocast:
                loss = cross_entropy_loss(model, batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            value = loss.item()  # a float, so nothing keeps the graph alive
            del batch, loss
            seconds = time.perf_counter() - started
            losses.append(value)
            record = {"step": step, "loss": value, "seconds": round(seconds, 6), "batch_size": batch_size}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if step % log_every == 0 or step == steps:
                log.info("step %d/%d loss=%.4f %.3fs", step, steps, value, seconds)
            if every and step % every == 0:
                checkpoints.append(str(_save_checkpoint(checkpoint_dir, step, workload)))
    optimizer.zero_grad(set_to_none=True)
    return {
        "batch_size": batch_size,
        "steps": steps,
        "samples": steps * batch_size,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "elapsed_s": time.perf_counter() - began,
        "checkpoints": checkpoints,
    }
