"""Build a config's ``_target_`` objects (model, optimizer, dataset) with errors that name the key.

Hydra reports a constructor that rejects a value as "Error in call to target '...':
ValueError(...)", which names neither the config key nor the override that set the value.
:func:`construct` turns it into one ``ValueError`` line naming both (bad input, exit status 2);
an exception that is not about the arguments (out of memory, an error in the user's code)
is raised as it is; a ``RuntimeError`` torch raises for a value (a negative size) is bad input
too, one the user's own code raises is not. A constructor that cannot open what a value names (``root: /missing``:
``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``) is bad input too: the same
one line, naming the key and the path. Under ``hydra.job.chdir=true`` a relative path named as
one (``root: data``) is from the directory the command ran in (:func:`from_launch_dir`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..errors import in_packages, raised_through
from ..memory.oom import is_oom_error
from .errors import one_line, where_raised

__all__ = ["construct", "from_launch_dir", "without_partial"]

#: The exceptions a constructor raises for a value it rejects: bad input, exit status 2.
_REJECTED = (ValueError, TypeError, IndexError, KeyError, AssertionError)
#: A torch value check fails as ``RuntimeError`` (``torch.nn.Linear(-1, 3)``: "Trying to create
#: tensor with negative dimension"): bad input too where torch raised it, unless it is out of
#: memory (:func:`_rejected`); one the user's own code raises is a bug of theirs, raised as it is.
_TORCH_REJECTED = RuntimeError
#: A path among its arguments that does not exist, is not a directory, or may not be read:
#: bad input as well (a wrong ``root``), not a failure at run time.
_UNOPENABLE = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
#: Constructor arguments named as a file or directory (``root``, ``data_dir``, ``csv_file``, ``data_files``).
_PATH_NAME = re.compile(r"(?:^|_)(?:root|path|dir|directory|file|filename)s?$")
#: The other keys whose value reaches a group's constructor (``optimizer.lr`` is ``train.lr``).
_FED_BY = {"optimizer": ("train.lr",)}


def _overrides_of(key: str) -> list[str]:
    """The command line's overrides that set ``key`` 's values (``key=option``, ``key.x=``,
    ``+key.x=``, and the keys in :data:`_FED_BY`); empty outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    from .user_config import given_overrides

    if not HydraConfig.initialized():
        return []
    key = key.split("[", 1)[0]  # a list's item (scheduler.schedulers[0]) is set by the list's override
    keys = (key, *_FED_BY.get(key, ()))
    return [
        override for override in given_overrides()
        if override.lstrip("+~").split("=", 1)[0].split("@", 1)[0] in keys
        or override.lstrip("+~").startswith(tuple(f"{k}." for k in keys))
    ]  # fmt: skip


def construct(key: str, node: Any, expect: type | None = None, *, keep_partial: bool = False, **kwargs: Any) -> Any:
    """``instantiate(node)`` for the config key ``key`` (``model``, ``optimizer``,
    ``data.dataset``). A value its constructor rejects (``optimizer.betas=[0.9]``,
    ``train.lr=-1``, ``model.dropout=1.5``) is one ``ValueError`` line naming ``key``, its
    ``_target_`` and the command line's overrides of it, instead of Hydra's "Error in call to
    target"; any other exception (out of memory, an error in the user's code) is raised as it
    is. A path it cannot open (``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``)
    is reported the same way. Where the user's own code raised it (a ``KeyError`` in a model's
    ``__init__``), the line also names that file and line, and the ``ValueError`` is chained to
    it, so ``AUTOBATCH_TRACEBACK=1`` shows the constructor's traceback. Relative paths under a
    path's name are from the directory the command ran in (:func:`from_launch_dir`). ``expect``: the type the object must be (a model
    ``torch.nn.Module``); anything else is one line naming ``key._target_`` (before, a class that
    built something else failed later on a missing method, ``'X' object has no attribute 'to'``).
    ``keep_partial``: a top-level ``_partial_: true`` builds a ``functools.partial``, as Hydra does
    (a loss function, which the program calls on each batch)."""
    given_node = node
    node = from_launch_dir(node) if keep_partial else without_partial(from_launch_dir(node))
    try:
        built = instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        key, inner = _nested_key(key, exc, given_node)
        if inner is not None and isinstance(cause, ImportError) and str(exc).startswith("Error locating target"):
            from .build import _check_target  # a nested _target_ misspelt: the line the top-level one gets

            _check_target(key, inner)
        if not _rejected(cause):
            if cause is not None:
                raise cause from None
            raise
        target = (inner if inner is not None else node).get("_target_") if hasattr(node, "get") else None
        given = _overrides_of(key)
        fix = f"check {' '.join(given)}" if given else f"check the {key} keys (python -m autobatch probe --cfg job)"
        what = "could not open a path it was given" if isinstance(cause, _UNOPENABLE) else "rejected its arguments"
        if isinstance(cause, _UNOPENABLE) and _moved_from() is not None:
            fix += (f" (hydra.job.chdir=true runs the job in {Path.cwd()}: a relative path is from there unless it exists "
                    "where the command ran and its argument is named root, path, dir, directory, file or filename, a "
                    "plural of one, or ends in _ and one of them (data_dir); or give "
                    "${hydra:runtime.cwd}/PATH)")
        code = where_raised(cause, users_only=True)  # a bug of the user's constructor, not an argument
        fix = (not code and _missing_arguments(key, cause)) or fix  # its own call, not one inside it
        fix += f", or your code that raised it{code}" if code else ""
        # from cause: AUTOBATCH_TRACEBACK=1 shows the constructor's own traceback (from None hid it)
        raise ValueError(f"{key}: {target} {what} ({type(cause).__name__}: {one_line(cause)}); {fix}") from cause
    if expect is not None and not isinstance(built, expect):
        target = node.get("_target_") if hasattr(node, "get") else None
        kind = f"{type(built).__module__}.{type(built).__qualname__}"
        raise ValueError(f"{key}._target_={target!r} built a {kind}, not a {_public_name(expect)}; "
                         f"give a class (or a function) that returns one")
    return built


def _nested_key(key: str, exc: InstantiationException, node: Any) -> tuple[str, Any]:
    """The key and node of the nested ``_target_`` that failed (``data.dataset.transform``, from Hydra's
    ``full_key: transform``), else ``(key, None)``. Before, its missing argument was told as one of the
    outer class's (``give +data.dataset.factor=VALUE``, which that class refuses) and its misspelt
    ``_target_`` was Hydra's "Error loading 'mypkg.Scal'", naming no key and not the class meant."""
    found = re.search(r"\nfull_key: (\S+)$", str(exc))
    if not (found and isinstance(node, DictConfig)):
        return key, None
    own = node._get_full_key(None)  # the node's place in the whole config ("data.dataset"): Hydra's key is from the root
    path = found.group(1)[len(own) + 1:] if own and found.group(1).startswith(f"{own}.") else found.group(1)
    inner = OmegaConf.select(node, path, default=None)
    if not (isinstance(inner, DictConfig) and "_target_" in inner):  # a list item's full_key is Hydra's "x0"
        return key, None
    return f"{key}.{path}", inner


def without_partial(node: Any) -> Any:
    """``node`` without a top-level ``_partial_: true``, which Hydra configs (the
    lightning-hydra-template's among them) put on an optimizer or scheduler so that the program
    fills in the rest: autobatch is that program and passes the model's parameters (the
    scheduler's optimizer) itself, so the node is built whole. Before, Hydra returned a partial
    and the run stopped on "built a hydra._internal.target_policy._DeferredTarget, not a
    torch.optim.Optimizer", which named neither ``_partial_`` nor what to change. A nested
    ``_partial_`` (a model's ``activation: {_target_: ..., _partial_: true}``) is the user's
    argument and stays. Unchanged (the same object) without one."""
    if not (hasattr(node, "get") and node.get("_partial_") is True):
        return node
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    assert isinstance(plain, dict)
    plain.pop("_partial_")
    return plain


def _rejected(cause: BaseException | None) -> bool:
    """Whether a constructor's exception is about what it was given (bad input, exit status 2):
    :data:`_REJECTED`, :data:`_UNOPENABLE`, or a ``RuntimeError`` that torch raised while the object
    was built, before any training (a negative size, in the class or in the user's ``__init__``
    that called it), which was reported as a failure at run time. Out of memory, a
    ``RecursionError`` and a ``RuntimeError`` the user's own code raises are raised as they are."""
    if isinstance(cause, (*_REJECTED, *_UNOPENABLE)):
        return True
    if not isinstance(cause, _TORCH_REJECTED) or isinstance(cause, RecursionError) or is_oom_error(cause):
        return False
    raiser = raised_through(cause)[-1:]  # the frame of the raise: torch's for a value torch refused
    return bool(raiser) and in_packages(raiser[0][0], ("torch",))


#: Python's words for a call that left out required arguments (``missing 1 required positional
#: argument: 'width'``; ``... arguments: 'a' and 'b'``; ``... keyword-only argument: 'c'``).
_MISSING = re.compile(r"missing \d+ required (?:positional |keyword-only )?arguments?: (.+)$")


def _missing_arguments(key: str, cause: BaseException) -> str:
    """``give +key.width=VALUE`` for a constructor that a required argument was not given to; ""
    for any other rejection. Before, the line said ``check model=target model._target_=...``,
    which named the override that was right and not the argument to add."""
    found = _MISSING.search(str(cause)) if isinstance(cause, TypeError) else None
    if found is None:
        return ""
    names = re.findall(r"'(\w+)'", found.group(1))
    if names and "[" in key:  # an item of a list (scheduler.schedulers[0]): no +key.name= override reaches it
        return f"give {key} " + ", ".join(f"{name}: VALUE" for name in names)
    return "give " + " ".join(f"+{key}.{name}=VALUE" for name in names) if names else ""


def _public_name(kind: type) -> str:
    """``kind`` by the shortest import path that reaches it (``torch.nn.Module``, not
    ``torch.nn.modules.module.Module``)."""
    parts = kind.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is not None and getattr(module, kind.__qualname__, None) is kind:
            return f"{module.__name__}.{kind.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _moved_from() -> Path | None:
    """The directory the command ran in, when ``hydra.job.chdir=true`` moved the job out of it
    (None: the job runs where the command ran, or outside a Hydra run)."""
    if not HydraConfig.initialized():
        return None
    launch = Path(HydraConfig.get().runtime.cwd)
    return None if launch.resolve() == Path.cwd().resolve() else launch


def _path_values(value: Any, launch: Path) -> Any:
    """``value`` (a string or a list of them) with each relative path that exists under
    ``launch`` made absolute there; anything else as it is."""
    if isinstance(value, list):
        return [_path_values(item, launch) for item in value]
    if isinstance(value, str) and value and "://" not in value and not Path(value).expanduser().is_absolute():
        if (launch / value).exists():
            return str(launch / value)
    return value


def _absolute_paths(node: Any, launch: Path) -> Any:
    if isinstance(node, dict):
        return {key: _path_values(value, launch) if isinstance(key, str) and _PATH_NAME.search(key)
                and not isinstance(value, dict) else _absolute_paths(value, launch) for key, value in node.items()}
    if isinstance(node, list):
        return [_absolute_paths(item, launch) for item in node]
    return node


def from_launch_dir(node: Any) -> Any:
    """``node`` (a ``_target_`` node's arguments) as the user meant it under ``hydra.job.chdir=true``:
    a relative path under a path's name (``root``, ``path``, ``dir``, ``directory``, ``file``,
    ``filename``, their plurals, or ``_`` and one of them at the end, in nested nodes too) that exists
    in the directory the command ran in is made absolute there, as ``probe.cache_dir`` and
    ``train.resume`` are. Without it the job, moved into its run directory, looked for
    ``root: data`` there, while ``train``'s probe child (:mod:`.isolated`), which starts where the
    command ran, found it: the probe ran, then training failed. A path that does not exist there
    (a download root, a hub name such as ``gpt2``) and every other argument are left as given.
    Unchanged (the same object) when the job runs where the command ran."""
    launch = _moved_from()
    if launch is None:
        return node
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return _absolute_paths(plain, launch)
