"""Apply a function to every tensor of a batch, keeping its structure; move batches to a device.

A batch is a tensor or a (nested) tuple, list, named tuple, dict or dataclass of tensors, as in
:mod:`autobatch.planning.accumulation`. The runner moves each micro-batch to the device just before
its forward (so a global batch never has to fit on the device at once), and builds the
planner's batches of any size from the first global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from ..memory.simulated import to_simulated_device
from ..planning.dataclass_batches import rebuilt
from ..planning.mapping_batches import rebuilt_mapping

__all__ = ["map_tensors", "to_device"]


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor], *, scalars: bool = False) -> Any:
    """Apply ``fn`` to every tensor of ``batch`` with a batch dimension (and to 0-dim tensors
    too when ``scalars``), keeping its structure; other leaves are kept as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch) if scalars or batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return rebuilt_mapping(batch, {key: map_tensors(value, fn, scalars=scalars) for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # rebuilt as dataclasses.replace does
        return rebuilt(batch, lambda name, value: map_tensors(value, fn, scalars=scalars))
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_tensors(value, fn, scalars=scalars) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(value, fn, scalars=scalars) for value in batch)
    return batch


def to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of ``batch`` to ``device`` (a tensor already there is returned as is).

    On the CPU under :func:`~autobatch.simulated_memory`, a host tensor is copied into the
    simulated device's memory, as the transfer to a GPU would (so the runner's step holds what
    a probe trial held: the micro-batch's inputs on the device)."""
    if torch.device(device).type == "cpu":
        return map_tensors(batch, lambda tensor: _to_simulated(tensor.to(device)), scalars=True)
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True), scalars=True)


def _to_simulated(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`~autobatch.memory.simulated.to_simulated_device` for a sparse COO tensor too, which
    has no storage of its own ("Cannot access storage of SparseTensorImpl"): its indices and values
    are moved, and it is built again from them."""
    if tensor.layout != torch.sparse_coo:
        return to_simulated_device(tensor)
    return torch.sparse_coo_tensor(to_simulated_device(tensor._indices()), to_simulated_device(tensor._values()),
                                   tensor.shape, is_coalesced=tensor.is_coalesced())
