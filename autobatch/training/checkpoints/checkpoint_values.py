"""What a runner checkpoint holds beyond the model's state, and that every value in it loads.

Two gaps a resume used to fall into, closed here:

* Parameters the optimizer trains outside the model (a CLIP-style loss module's
  ``logit_scale``, a free ``nn.Parameter``) are in no ``model.state_dict()``: a checkpoint of the
  model alone resumed them at their initial values and the run silently diverged (measured:
  ``logit_scale`` 2.5916 resumed against 2.4756 uninterrupted). :func:`loose_parameters` finds
  them, keyed by their place in the optimizer (``"group.index"``, stable across processes, as
  ``optimizer.state_dict()`` keys its state), and :func:`load_loose_parameters` puts them back.
* A checkpoint is read with ``torch.load(weights_only=True)``, which refuses anything but
  tensors and plain values. A numpy scalar (``SGD(lr=np.float64(0.02))``) was written into
  ``param_groups`` and the runner's own loader then refused the file. :func:`storable` converts
  numpy scalars to Python values and refuses, at save time and naming it, a value no such load
  can read: a checkpoint that cannot be resumed is never written.
"""

from __future__ import annotations

import collections
import logging
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from ...errors import CheckpointError
from ...probe.snapshot.shards import local, plain_state
from .extra_state import saved_extra_state

__all__ = ["loose_parameters", "saved_loose_parameters", "check_loose_parameters", "load_loose_parameters", "storable",
           "check_storable"]

log = logging.getLogger("autobatch")

#: Types ``torch.load(weights_only=True)`` reads back as they were written (exact types: an
#: ``int`` subclass such as an ``IntEnum`` pickles as its class, which that load refuses).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.device, torch.dtype)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)


def loose_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The parameters ``optimizer`` trains that ``model`` does not hold, keyed ``"group.index"``
    (their place in ``optimizer.param_groups``); the model's own are in its state dict."""
    held = {id(param) for param in model.parameters()}
    return {
        f"{group_index}.{index}": param
        for group_index, group in enumerate(optimizer.param_groups)
        for index, param in enumerate(group["params"])
        if id(param) not in held
    }


def saved_loose_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """:func:`loose_parameters` as a checkpoint stores them: detached, a ``DTensor`` as this
    rank's local shard (plain tensors, as the model's state)."""
    return {key: plain_state(param.detach()) for key, param in loose_parameters(model, optimizer).items()}


def check_loose_parameters(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           saved: dict[str, torch.Tensor] | None) -> None:
    """One :class:`~autobatch.errors.CheckpointError` where the checkpoint's parameters trained
    outside the model are another set than this run's, or of another shape: called before the
    resume loads anything, so a refused resume leaves the model and optimizer as they were."""
    if saved is None:
        return
    current = loose_parameters(model, optimizer)
    if set(saved) != set(current):
        raise CheckpointError(
            path, f"the parameters its optimizer trained outside the model were at optimizer group.index "
            f"{sorted(saved) or 'none'}, and this run's are at {sorted(current) or 'none'}; resume with the model, "
            "loss module and optimizer it was trained with, or start afresh",
        )
    for key, param in current.items():
        target = local(param)
        if tuple(target.shape) != tuple(saved[key].shape):
            raise CheckpointError(
                path, f"its parameter at optimizer group.index {key} (trained outside the model) has shape "
                f"{tuple(saved[key].shape)} and this run's {tuple(target.shape)}; resume with the loss module it was "
                "trained with, or start afresh",
            )


def load_loose_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          saved: dict[str, torch.Tensor] | None) -> None:
    """Copy the checkpoint's parameters trained outside the model back in place. A checkpoint
    of an earlier version holds none (``saved`` None): it still loads, with a warning where this
    run's optimizer trains such parameters (they keep this run's values). The caller checks
    first with :func:`check_loose_parameters`, before it loads anything else (another set of
    them, or another shape, is one :class:`~autobatch.errors.CheckpointError` there)."""
    current = loose_parameters(model, optimizer)
    if saved is None:
        if current:
            log.warning(
                "resume: the checkpoint holds the model's parameters but not the %d the optimizer trains outside it "
                "(optimizer group.index %s; a loss module's, say): it was written by an earlier version. They keep "
                "this run's values, so the resumed run differs from the uninterrupted one",
                len(current), ", ".join(sorted(current)),
            )
        return
    for key, param in current.items():
        with torch.no_grad():
            local(param).copy_(saved[key])


def storable(value: Any, where: str = "checkpoint", *, any_tensor: bool = False) -> Any:
    """``value`` with every numpy scalar (a dict's keys too) made the Python value it holds, so that
    ``torch.load(weights_only=True)`` reads it back; a ``TypeError`` naming ``where`` in it for
    a value that load cannot read (a numpy array, an enum, a named tuple, an arbitrary object),
    unless its type was allowed with ``torch.serialization.add_safe_globals``. Containers are
    rebuilt only where something in them changed; tensors are never copied. ``any_tensor``: a
    tensor of any subclass passes (:func:`check_storable`: a lazy module's, materialized by the save)."""
    kind = type(value)
    if kind in _PLAIN or kind in _TENSORS or kind is torch.Size or (any_tensor and isinstance(value, torch.Tensor)):
        return value
    if kind in _MAPPINGS:  # keys too: a metric's dict keyed by np.unique's np.int64 labels was written, then refused
        items = [(storable(key, f"{where}'s key {key!r}", any_tensor=any_tensor),
                  storable(item, f"{where}[{key!r}]", any_tensor=any_tensor)) for key, item in value.items()]
        changed = any(new is not old for pair, olds in zip(items, value.items()) for new, old in zip(pair, olds))
        return kind(dict(items)) if changed else value  # a Counter of pairs would count them
    if kind in (list, tuple, set):
        items = [storable(item, f"{where}[{index}]", any_tensor=any_tensor) for index, item in enumerate(value)]
        changed = any(new is not old for new, old in zip(items, value))
        return kind(items) if changed else value
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic) and type(value.item()) in _PLAIN:
        return value.item()  # np.float64(0.02) -> 0.02: the same number, read back by a weights-only load
    if kind in _safe_globals():
        return value
    raise TypeError(
        f"cannot write a checkpoint: {where} is a {kind.__module__}.{kind.__qualname__} ({value!r:.80}), which a "
        "checkpoint loaded with torch.load(weights_only=True) cannot hold, so the run could not be resumed from it. "
        "Make it a Python number or string, a list, tuple or dict of them, or a tensor (e.g. lr=float(value)), or "
        "allow its type with torch.serialization.add_safe_globals",
    )


def check_storable(optimizer: torch.optim.Optimizer, scheduler: Any, extra_state: Mapping[str, Any]) -> None:
    """:func:`storable`'s ``TypeError``, naming the same place, for the optimizer's settings, the scheduler's state
    and ``Runner(extra_state=)``'s when ``fit`` starts with a ``checkpoint_dir``: found at the first save, a value no
    checkpoint holds (a dataclass in an extra state, an enum in a param group) stopped the run ``checkpoint_every``
    steps in, or after its last step where only the end saves, and the process then exited with every step trained
    lost. The optimizer's state (tensors, filled as it steps) is not walked; a value set later (in ``on_step_end``)
    is still refused by that save, before anything is written."""
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    storable({"optimizer": {"param_groups": groups}, "scheduler": None if scheduler is None else scheduler.state_dict(),
              "extra_state": saved_extra_state(extra_state)}, any_tensor=True)


def _safe_globals() -> set[Any]:
    """Types the user allowed ``torch.load(weights_only=True)`` to read."""
    found = set()
    for entry in torch.serialization.get_safe_globals():
        found.add(entry[0] if isinstance(entry, tuple) else entry)
    return found
