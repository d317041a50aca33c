"""A ``_target_`` as the command line typed it: the forms that are no import path, each with
the one to type instead.

A Hydra user quotes: ``model._target_='"torchvision.models.resnet18"'`` (the shell takes one
pair of quotes off, Hydra the next; a third is part of the value), copies an entry point's
``package.module:Name`` or writes the call ``mymodels.Net()``. Each failed as "no module named
``'"torchvision``" or "``mymodels`` has no attribute ``'Net()'``", which did not say that the
path was right and its spelling was not. :func:`target_form_error` names the path to type.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["target_form_error"]

#: A dotted Python path: identifiers joined by dots.
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_QUOTES = "'\"` \t"


def target_form_error(key: str, target: Any) -> str | None:
    """The message for a ``key._target_`` that is no dotted import path but plainly means one
    (quoted, with a colon, called, spaced), naming the form to type; None for any other value
    (an import path, right or wrong, is for the import to judge)."""
    if not isinstance(target, str):
        return (f"{key}._target_ is {type(target).__name__} {target!r}, not an import path; give the dotted path of "
                f"the class or function, e.g. {key}._target_=my_project.Thing")
    if _DOTTED.match(target):
        return None
    path = target.strip(_QUOTES)
    if path != target and _DOTTED.match(path):
        why = ("its quotes are part of the value (the shell and Hydra each take one pair off)"
               if path != target.strip() else "its spaces are part of the value")
    elif path.count(":") == 1 and _DOTTED.match(path.replace(":", ".")):
        path, why = path.replace(":", "."), "an import path joins the module and the name with a dot, not a colon"
    elif path.endswith("()") and _DOTTED.match(path[:-2]):
        path, why = path[:-2], f"autobatch calls it (its arguments: +{key}.<argument>=VALUE)"
    else:
        return None
    return f"{key}._target_={target!r} is no import path: {why}; give {key}._target_={path}"
