"""A dataclass batch rebuilt with each field mapped: a micro-batch's piece, or the batch moved to a device.

:func:`~autobatch.planning.samples.map_samples` (the split) and
:func:`~autobatch.training.batch_ops.map_tensors` (the move to the device) rebuild a dataclass
batch through its ``__init__``, as ``dataclasses.replace`` does, so that a field its
``__post_init__`` derives (``count = len(input_ids)``) follows the piece, not the whole batch.
Kinds of dataclass that broke (review 33, 36):

* a field with ``init=False`` that the collate sets after construction (``batch.mask = ...``)
  is not passed to ``__init__``: every piece, and every move to the device even of a batch
  trained in one micro-batch, got the field's default (``None``: the loss failed deep inside,
  ``unsupported operand type(s) for *: 'Tensor' and 'NoneType'``; a default number: the wrong
  value, without a word). Such a field is told from a derived one by rebuilding the whole batch
  unchanged: a derived field comes back as it is, a field set later does not; it is mapped like
  the others (its tensors cut) and set on the piece.
* an ``InitVar`` with no default cannot be passed again: ``dataclasses.replace``'s bare "InitVar 'scale' must
  be specified with replace()" named nothing to change (review 36); one ``ValueError`` naming the class does;
* a ``__post_init__`` that changes the values it is given (``self.x = self.x / 255``) ran again
  on every piece and every move, so the model trained ``x / 255 / 255`` (0.2 off one plain
  step's weights). No rebuild can undo it: one ``ValueError`` naming the fields and what to change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

__all__ = ["rebuilt", "same_values"]


def rebuilt(node: Any, mapped: Callable[[str, Any], Any], path: str = "batch") -> Any:
    """``node`` (a dataclass instance) rebuilt through its ``__init__`` with every field's value
    ``mapped(name, value)``; ``init=False`` fields set after construction mapped and set too.
    One ``ValueError`` where ``__post_init__`` changes the fields it is given (``path`` names it)."""
    fields = dataclasses.fields(node)
    try:
        again = dataclasses.replace(node)  # the batch rebuilt unchanged: what __init__ makes of its own fields
    except (ValueError, TypeError) as error:  # dataclasses' own "InitVar 'scale' must be specified with replace()"
        if not str(error).startswith("InitVar "):
            raise
        raise ValueError(
            f"{path} is a dataclass ({type(node).__name__}) with an InitVar that has no default ({error}): autobatch "
            "builds each micro-batch, and the batch moved to the device, through __init__ (as dataclasses.replace "
            "does), which cannot pass it. Make it a field (each piece then gets its value), or give it a default"
        ) from error
    changed = [field.name for field in fields if field.init and not same_values(getattr(again, field.name), getattr(node, field.name))]
    if changed:
        raise ValueError(
            f"{path} is a dataclass ({type(node).__name__}) whose __init__ / __post_init__ changes the values it is given "
            f"({', '.join(changed)}: rebuilt from its own fields, they come back different). autobatch builds each "
            "micro-batch, and the batch moved to the device, through __init__ (as dataclasses.replace does), which would "
            "apply that change again to every piece. Do the change in the collate_fn (or the loss_fn), or make "
            "__post_init__ leave a value it already changed as it is")
    piece = dataclasses.replace(node, **{field.name: mapped(field.name, getattr(node, field.name))
                                         for field in fields if field.init})
    for field in fields:  # set after construction: not derived, so lost by the rebuild
        if not field.init and not same_values(getattr(again, field.name, None), getattr(node, field.name, None)):
            object.__setattr__(piece, field.name, mapped(field.name, getattr(node, field.name)))  # frozen ones too
    return piece


def same_values(left: Any, right: Any) -> bool:
    """Whether ``left`` and ``right`` hold the same values: the same object, equal tensors, or
    lists, tuples and mappings of such, element by element (also how a resume compares generator
    states: :mod:`~autobatch.training.epochs`)."""
    if left is right:
        return True
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and left.shape == right.shape
                and left.dtype == right.dtype and left.layout == right.layout and left.device == right.device):
            return False
        try:
            return bool(torch.equal(left, right))
        except (RuntimeError, NotImplementedError):  # a layout torch cannot compare (nested): not known to be the same
            return False
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() == right.keys() and all(same_values(left[key], right[key]) for key in left)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return type(left) is type(right) and len(left) == len(right) and all(map(same_values, left, right))
    try:
        return bool(left == right)
    except Exception:  # noqa: BLE001 - a value with no truth to its ==: not known to be the same
        return False
