"""Import the object a ``_target_`` names, or say which part of its dotted path is wrong and what was meant.

Kept apart from :mod:`autobatch.cli.build` (which turns a config into a workload) because finding the closest
name is its own concern: a misspelt class (``mymodels.MyNte``) was told ``did you mean mymodels.MyNet?``, but a
misspelt module (``model._target_=mymodel.Net`` beside ``mymodels.py``) was told only "no module named
'mymodel'", and a misspelt submodule of a package that imports (``mypkg.modls.Net``) was looked for among
the package's attributes, which hold no submodule it has not imported. :func:`locate` names the closest
module too: among the current directory's ``*.py`` files and packages (where ``python -m autobatch`` imports
a user's own code from), and among the parent package's submodules.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import pkgutil
from types import ModuleType
from typing import Any

from .errors import one_line, where_raised

__all__ = ["locate", "near_module"]


def _local_modules(folder: str) -> list[str]:
    """The names of the modules in ``folder``: its ``*.py`` files and its packages (folders with ``__init__.py``)."""
    names = []
    for entry in os.scandir(folder):
        name, ext = os.path.splitext(entry.name)
        if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "__init__.py")):
            name, ext = entry.name, ".py"
        if ext == ".py" and name.isidentifier() and not name.startswith("__"):
            names.append(name)
    return sorted(names)


def near_module(name: str) -> str | None:
    """The module closest to ``name`` (a top-level module that is not there) among the current directory's,
    named only where the import system finds it (never one of a folder that is not on ``sys.path``)."""
    for near in difflib.get_close_matches(name, _local_modules(os.curdir), n=3):
        if importlib.util.find_spec(near) is not None:
            return near
    return None


def _attributes(obj: Any) -> list[str]:
    """The public names of ``obj``, and where it is a package, its submodules (found on its ``__path__``, none
    imported: a submodule the package does not import is no attribute of it until imported)."""
    names = [name for name in dir(obj) if not name.startswith("_")]
    if isinstance(obj, ModuleType) and getattr(obj, "__path__", None) is not None:
        names += [info.name for info in pkgutil.iter_modules(obj.__path__) if info.name not in names]
    return names


def locate(path: str) -> Any:
    """Import the object at a dotted ``path`` (``torch.optim.AdamW``); ``ImportError`` names
    the part that is missing, and the closest name there (``mymodels.MyNte``: did you mean
    ``mymodels.MyNet``?; ``mymodel.Net`` beside ``mymodels.py``: did you mean ``mymodels.Net``?).
    (Hydra's own ``get_object`` also logs the failure.)"""
    parts = path.split(".")
    if not all(parts):
        raise ImportError(f"{path!r} is not a dotted import path")
    module, found = None, 0
    for index in range(len(parts), 0, -1):
        name = ".".join(parts[:index])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not name.startswith(exc.name) and not exc.name.startswith(name):
                # a module it imports is missing: chained, with where the import is (it was `from None`, no place)
                raise ImportError(f"importing {name} failed: {exc}{where_raised(exc)}") from exc
            continue
        except Exception as exc:  # the module's own code failed (SyntaxError, NameError...): chained, never hidden
            raise ImportError(f"importing {name} raised {type(exc).__name__}: {one_line(exc)}{where_raised(exc)}") from exc
        found = index
        break
    if module is None:
        near = near_module(parts[0])
        hint = f"; did you mean {'.'.join([near, *parts[1:]])}?" if near else ""
        raise ImportError(f"no module named {parts[0]!r}{hint}")
    obj: Any = module
    for index in range(found, len(parts)):
        if not hasattr(obj, parts[index]):
            near = difflib.get_close_matches(parts[index], _attributes(obj), n=1)
            hint = f"; did you mean {'.'.join(parts[:index] + near + parts[index + 1:])}?" if near else ""
            raise ImportError(f"{'.'.join(parts[:index])} has no attribute {parts[index]!r}{hint}")
        obj = getattr(obj, parts[index])
    return obj
