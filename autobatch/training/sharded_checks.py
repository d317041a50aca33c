"""Before a resume loads anything: does the checkpoint fit this run's model and optimizer?

``load_state_dict`` copies every entry that fits before it raises on the rest, so a check that
runs during the load leaves the model part the checkpoint's. Both checkpoint kinds are checked
up front here, the same way: an unsharded one against the model's state
(:func:`~autobatch.training.resume_checks.check_fits`), a sharded (FSDP2) one against this
rank's local shards (:func:`check_sharded_fits`); then the weights' dtypes
(:func:`~autobatch.training.precision.check_dtypes`: a warning naming the change, an error
where float16 would overflow). Before, a sharded resume had neither: a model with an extra or
missing parameter, or an optimizer with other parameter groups, failed only while loading, after
the scheduler and extra state (and, for the groups, the weights) were loaded; and bfloat16 shards
resumed into a float32 model were cast without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..probe.shards import local
from .precision import check_dtypes
from .resume_checks import check_fits

__all__ = ["check_sharded_fits", "check_model_fits"]


def check_sharded_fits(model: torch.nn.Module, saved_model: dict[str, Any], optimizer: torch.optim.Optimizer,
                       saved_optimizer: dict[str, Any]) -> None:
    """A ``ValueError`` naming the mismatches where a sharded checkpoint file (this rank's local
    shards) does not fit ``model`` 's keys and local shard shapes, or ``optimizer`` 's parameter
    groups (their number and sizes), before anything is loaded."""
    mine = {name: local(value) for name, value in model.state_dict().items()}
    missing, unexpected = sorted(set(mine) - set(saved_model)), sorted(set(saved_model) - set(mine))
    problems = []
    if missing:
        problems.append(f"this model has parameter(s) the checkpoint lacks: {', '.join(missing[:4])}")
    if unexpected:
        problems.append(f"the checkpoint has parameter(s) this model lacks: {', '.join(unexpected[:4])}")
    shapes = [f"{name} {tuple(saved_model[name].shape)} (this rank's shard: {tuple(value.shape)})"
              for name, value in mine.items() if isinstance(value, torch.Tensor)
              and isinstance(saved_model.get(name), torch.Tensor) and saved_model[name].shape != value.shape]
    if shapes:
        problems.append(f"size mismatch for {', '.join(shapes[:4])}")
    groups = [len(group["params"]) for group in optimizer.param_groups]
    saved_groups = [len(group.get("params", ())) for group in saved_optimizer.get("param_groups", [])]
    if saved_groups != groups:
        problems.append(f"optimizer parameter groups of {saved_groups} parameters (this optimizer: {groups})")
    if problems:
        raise ValueError("; ".join(problems))


def check_model_fits(path: Path, model: torch.nn.Module, saved_model: dict[str, Any], optimizer: torch.optim.Optimizer,
                     saved_optimizer: dict[str, Any], *, sharded: bool) -> None:
    """Everything a resume checks of the model and optimizer state before it loads any of it:
    shapes and groups (a ``ValueError``), then dtypes (a warning, or a
    :class:`~autobatch.errors.CheckpointError` where float16 would overflow); ``saved_model``
    already without a wrapper's key prefix."""
    (check_sharded_fits if sharded else check_fits)(model, saved_model, optimizer, saved_optimizer)
    check_dtypes(path, model, saved_model)
