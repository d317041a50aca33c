"""What each part of a batch is, for the rule that cuts it: containers, plain values, NumPy arrays.

:mod:`~autobatch.planning.samples` reads a batch by one rule (``docs/runner.md``, "What a batch
may hold") that turns on what each part is: a container of fields (a dict, a dataclass, a named
tuple, a list or tuple) and its children, a plain value (a number, a string, an object: no tensor
and no mapping in it), or a NumPy array. These predicates are kept here, apart from the rule
itself, so that the rule's module reads as the rule (it had grown to its size limit), and so that
a batch's parts are told apart the same way everywhere the rule is applied.

A NumPy array with a dimension (labels or ids a custom ``collate_fn`` returns beside tensors:
``{"x": tensor[8, 3], "ids": np.arange(8)}``) holds the batch's samples on dim 0, as a tensor
does, where its length is the batch's: it is cut with them (:func:`picked`: a piece's view, or the
picked rows, keeping its type). NumPy is not imported here: where it is not loaded, no batch holds
one of its arrays.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from typing import Any, Iterable, Mapping

import torch

__all__ = ["children_of", "is_dataclass_instance", "is_named", "is_ndarray", "is_number", "is_plain",
           "leaf_sizes", "picked"]


def children_of(node: Any, path: str) -> list[tuple[str, Any]]:
    """``(path, value)`` of each part of a dict, dataclass, named tuple, list or tuple (none for a leaf)."""
    if isinstance(node, Mapping):
        return [(f"{path}[{key!r}]", value) for key, value in node.items()]
    if is_dataclass_instance(node):
        return [(f"{path}.{field.name}", getattr(node, field.name)) for field in dataclasses.fields(node)]
    if is_named(node):
        return [(f"{path}.{name}", value) for name, value in zip(node._fields, node)]
    if isinstance(node, (list, tuple)):
        return [(f"{path}[{index}]", value) for index, value in enumerate(node)]
    return []


def leaf_sizes(node: Any, path: str) -> list[tuple[str, int]]:
    """``(path, dim 0)`` of every tensor with a dimension in ``node``, for a message."""
    if isinstance(node, torch.Tensor):
        return [(path, node.shape[0])] if node.dim() > 0 else []
    return [found for where, value in children_of(node, path) for found in leaf_sizes(value, where)]


def is_named(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def is_dataclass_instance(node: Any) -> bool:
    """A dataclass instance (not the class), read as fields like a dict; a model output that is
    also a mapping (Hugging Face's ``ModelOutput``) is read as the mapping."""
    return dataclasses.is_dataclass(node) and not isinstance(node, type) and not isinstance(node, Mapping)


def is_plain(node: list | tuple) -> bool:
    """Whether ``node`` holds no tensor and no mapping, at any depth of lists and tuples."""
    return not any(isinstance(value, (torch.Tensor, Mapping)) or is_dataclass_instance(value)
                   or (isinstance(value, (list, tuple)) and not is_plain(value)) for value in node)


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Number)


def is_ndarray(node: Any) -> bool:
    """A NumPy array (of any dimension), without importing NumPy."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(node, numpy.ndarray)


def picked(found: Any, picks: Iterable[int]) -> Any:
    """The entries ``picks`` of a list, tuple or NumPy array of per-sample values, as its own type
    (an array's rows by index: a copy of its type, a subclass's too)."""
    if is_ndarray(found):
        numpy = sys.modules["numpy"]
        return found[numpy.asarray(list(picks), dtype=numpy.intp)]
    return type(found)(found[i] for i in picks)
