"""Optimizers that ``probe`` and ``train`` cannot step, refused with what to type instead.

Both commands run one forward and backward per micro-batch, then one ``optimizer.step()``
with no closure. An optimizer that cannot take that step was refused by the library's checks,
whose advice is for Python code: ``optimizer._target_=torch.optim.LBFGS`` on ``train`` was told
to "probe a plain callable fn(batch_size) ... find_max_batch(fn, ...)" (the probe's advice, also
with ``train.micro_batch`` set, where no probe runs), and ``torch.optim.SparseAdam`` on a model
with dense gradients failed at the probe's first step with torch's ``RuntimeError`` and the
frame it was raised in. Here each gets one line naming the key and the options to give.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from omegaconf import DictConfig

__all__ = ["check_optimizer_target", "check_optimizer_gradients"]

#: what the command line can train, as the user types it
_INSTEAD = "optimizer=adamw, optimizer=sgd, or optimizer=target optimizer._target_=torch.optim.Adam"


def _target_text(node: DictConfig) -> str:
    return f"optimizer._target_={node.get('_target_')}"


def check_optimizer_target(node: DictConfig, target: Any) -> None:
    """``ValueError`` when ``target`` (what ``optimizer._target_`` imports) is an optimizer whose
    ``step()`` needs a closure (``LBFGS``, or any whose ``closure`` argument has no default):
    refused before a model is built or a probe runs, as ``ReduceLROnPlateau`` is for the scheduler."""
    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)):
        return
    try:
        closure = inspect.signature(target.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step whose signature Python cannot read: the step's own check stays
        return
    if issubclass(target, torch.optim.LBFGS) or (closure is not None and closure.default is inspect.Parameter.empty):
        raise ValueError(
            f"{_target_text(node)} needs a closure in step(closure) (it re-evaluates the loss several times per "
            "step), and probe and train run one forward and backward per micro-batch, then one optimizer.step() "
            f"without one; choose a first-order optimizer: {_INSTEAD}"
        )


def _sparse_weights(model: torch.nn.Module) -> set[int]:
    """The parameters whose gradients are sparse: the weights of ``sparse=True`` embeddings."""
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return {id(module.weight) for module in model.modules() if isinstance(module, kinds) and module.sparse}


def check_optimizer_gradients(node: DictConfig, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """``ValueError`` when ``optimizer`` is a ``SparseAdam`` holding parameters of ``model`` that get
    dense gradients (all but ``sparse=True`` embeddings' weights): its first step would fail with
    "SparseAdam does not support dense gradients"."""
    if not isinstance(optimizer, torch.optim.SparseAdam):
        return
    sparse = _sparse_weights(model)
    names = {id(p): name for name, p in model.named_parameters()}
    dense = [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"] if id(p) not in sparse]
    if dense:
        shown = ", ".join(dense[:3]) + (", ..." if len(dense) > 3 else "")
        raise ValueError(
            f"{_target_text(node)} steps sparse gradients only, and {len(dense)} of the model's parameters get dense "
            f"ones ({shown}; only the weights of nn.Embedding(sparse=True) get sparse gradients); choose an "
            f"optimizer for dense gradients: {_INSTEAD}"
        )
