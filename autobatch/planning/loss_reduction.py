"""What a ``loss_fn`` shows of its reduction without being called: a sum, class weights.

The :class:`~autobatch.Runner` weights each micro-batch's loss by its share of the samples,
which trains one batch's gradient for a loss that is a mean over samples only.
:func:`~autobatch.plan` checks that by running the loss on ``make_batch``
(:func:`~autobatch.planning.split_checks.loss_split_note`); a Runner at its first change of split
mid-run (:mod:`autobatch.training.split_warnings`) calls ``loss_fn`` for training only, for a
``loss_fn`` may count its calls, log, or step a schedule: a check of four eval-mode calls at the
replay broke four tests that count calls, and stepped a ``OneCycleLR`` that a ``loss_fn`` steps
four times more, which changed the run's learning rates. So :func:`seen_reduction` reads what
is there to read:

* loss modules (``torch.nn``'s) reachable from ``loss_fn``: itself, its bound object, a
  ``functools.partial``'s arguments, a callable object's attributes, its closure and the
  globals its code names, and theirs (a helper function's), three levels deep, never into a
  model. ``reduction='sum'`` sums over samples; ``CrossEntropyLoss`` / ``NLLLoss`` with
  unequal class ``weight`` and ``reduction='mean'`` divide by the batch's summed weights;
* a call in those functions' source with the keyword ``reduction="sum"``
  (``F.cross_entropy(..., reduction="sum")``), and a ``functools.partial`` given it
  (``partial(F.smooth_l1_loss, reduction="sum")``: the command line's ``+loss._partial_=true``).

A sum in a function that divides (``/``, ``.div``, ``.mean``: ``... reduction="sum") / len(y)``
is a mean) is not taken for one. A hand-written ``.sum()``, a token mean over padded targets or a
contrastive loss are not seen here; ``plan()``'s check sees them (docs/runner.md).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import types
from typing import Any, Iterator

from torch import nn

from ..errors import in_packages
from ..probe.tracing.trace_state import code_references

__all__ = ["seen_reduction"]

_LEVELS = 3  # loss_fn -> a helper it calls -> the criterion the helper names
_SUM = re.compile(r"""reduction\s*=\s*["']sum["']""")
_DIVIDES = {"div", "div_", "divide", "true_divide", "mean"}


def seen_reduction(loss_fn: Any) -> str | None:
    """What in ``loss_fn`` makes it no mean over samples, read without calling it
    (``"criterion = CrossEntropyLoss(reduction='sum')"``); None where nothing is seen."""
    seen: set[int] = set()
    todo: list[tuple[Any, str, int, bool]] = [(loss_fn, "loss_fn", 0, False)]
    while todo:
        value, name, level, divides = todo.pop(0)
        if id(value) in seen or level > _LEVELS:
            continue
        seen.add(id(value))
        if isinstance(value, nn.modules.loss._Loss):
            found = _module_reduction(value, name, divides)
            if found:
                return found
            continue
        if isinstance(value, functools.partial) and value.keywords.get("reduction") == "sum" and not divides:
            return f"{name} = partial({getattr(value.func, '__qualname__', value.func)}, reduction='sum')"
        if isinstance(value, types.FunctionType):
            source = _source(value)
            divides = divides or (source is not None and _divides(source))
            if source is not None and not divides and _sums(source):
                return f"{value.__qualname__}() calls with reduction='sum'"
        todo += [(child, child_name, level + 1, divides) for child_name, child in _children(value, name)]
    return None


def _module_reduction(module: nn.Module, name: str, divides: bool) -> str | None:
    reduction = getattr(module, "reduction", "mean")
    shown = f"{name} = {type(module).__name__}(reduction={reduction!r}"
    if reduction == "sum" and not divides:
        return shown + ")"
    weight = getattr(module, "weight", None)
    if reduction == "mean" and isinstance(module, (nn.CrossEntropyLoss, nn.NLLLoss)) and weight is not None \
            and weight.numel() > 1 and bool((weight != weight.flatten()[0]).any()):
        return shown + ", weight=...) with unequal class weights"
    return None


def _children(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """What ``value`` holds or names that may be, or lead to, a loss module: never a model, a
    Python module, a class, or a library's function (its own reductions are its business)."""
    if isinstance(value, (functools.partial, types.MethodType, types.FunctionType)):
        yield from ((child_name or name, child) for child_name, child in code_references(value, _library))
    elif callable(value) and not isinstance(value, (type, types.ModuleType, nn.Module)) and hasattr(value, "__dict__"):
        yield name, getattr(type(value), "__call__", None)
        yield from vars(value).items()


def _library(function: types.FunctionType) -> bool:
    if in_packages(getattr(function, "__module__", None) or "", ("torch", "autobatch")):
        return True
    try:
        path = inspect.getsourcefile(function) or ""
    except TypeError:
        return True
    return "site-packages" in path or "dist-packages" in path


def _source(function: types.FunctionType) -> str | None:
    if _library(function):
        return None
    try:
        return textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):  # defined at a prompt, or in exec'd code
        return None


def _sums(source: str) -> bool:
    """Whether the source calls with the keyword ``reduction="sum"``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a lambda's lines cut from a larger statement
        return bool(_SUM.search(source))
    return any(isinstance(node, ast.keyword) and node.arg == "reduction" and isinstance(node.value, ast.Constant)
               and node.value.value == "sum" for node in ast.walk(tree))


def _divides(source: str) -> bool:
    """Whether the source divides (``/``, ``//``, ``.div()``, ``.mean()``): a sum it divides may be a mean."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a lambda's lines cut from a larger statement
        return "/" in source or any(f".{name}(" in source for name in _DIVIDES)
    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _DIVIDES:
            return True
    return False
