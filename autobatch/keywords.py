"""Keyword checks for every public entry point, the earliest stage's so that every stage can use
them (the memory stage's :func:`~autobatch.memory.simulated.simulated_memory` too, which cannot
import :mod:`autobatch.checks`): a keyword a function does not take is one ``TypeError`` naming
the one it does, and another of autobatch's own names for a parameter (``memory_limit`` for a
budget) is taken as that parameter. :mod:`autobatch.checks` re-exports both."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["keywords", "closest"]


def keywords(aliases: Mapping[str, str] | None = None, *, synonyms: Mapping[str, str] | None = None,
             inside: Mapping[str, str] | None = None, forwards: Any = None) -> Any:
    """Decorate a public function (or ``__init__``) so that a keyword it does not take is one
    ``TypeError`` naming the closest one it does: Python's own "got an unexpected keyword
    argument 'max_batch_size'" named no alternative. ``aliases``: a peer's name for one of them
    (Accelerate's ``starting_batch_size`` for ``start``, Lightning's ``mode`` for ``strategy``).
    ``synonyms``: another of autobatch's own names for one of its parameters, taken as that
    parameter (``estimate_max_batch(step, memory_limit="16GiB")``, as ``find_max_batch`` spells
    the budget, is ``capacity="16GiB"``); given with the parameter itself, one ``TypeError``.
    ``inside``: a keyword that goes in one of its dict parameters (``Runner(memory_limit=...)``
    in ``plan_options``), named with the call to write. ``forwards``: the callable a function's
    ``**kwargs`` go to (``train(..., **options)`` builds a ``Runner``): its keyword-only parameters
    are taken too, and a keyword neither takes is named against both, with the function's own name
    (without it such a function is left unchecked)."""
    def decorate(fn: Any) -> Any:
        parameters = dict(inspect.signature(fn).parameters)
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            if forwards is None:
                return fn
            parameters = {n: p for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
            parameters.update((n, p) for n, p in inspect.signature(forwards).parameters.items() if p.kind is p.KEYWORD_ONLY)
        names = [n for n, p in parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        label = fn.__qualname__.removesuffix(".__init__")
        positions = {n: i for i, (n, p) in enumerate(parameters.items()) if p.kind is p.POSITIONAL_OR_KEYWORD}

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            for key, meant in (synonyms or {}).items():
                if key in kwargs:
                    if meant in kwargs or positions.get(meant, len(args)) < len(args):
                        raise TypeError(f"{label}() got both {meant} and {key}, two names of one argument: pass one")
                    kwargs[meant] = kwargs.pop(key)
            for key in kwargs:
                if key not in parameters and key in (inside or {}):
                    raise TypeError(f"{label}() got an unexpected keyword argument {key!r}; it goes inside "
                                    f"{inside[key]}: pass {inside[key]}={{{key!r}: {kwargs[key]!r:.30}}}")
                if key not in parameters:
                    guess = closest(key, names, aliases)
                    raise TypeError(f"{label}() got an unexpected keyword argument {key!r}; "
                                    + (f"did you mean {guess!r}?" if guess else f"it takes {', '.join(names)}"))
            return fn(*args, **kwargs)

        return checked

    return decorate


def closest(value: str, names: Iterable[str], aliases: Mapping[str, str] | None = None) -> str | None:
    """The one of ``names`` that ``value`` means: the one ``aliases`` gives for it (a peer's name,
    Accelerate's ``starting_batch_size`` for ``start``), else the closest spelling; None where none
    is close. The did-you-mean of :func:`choice`, :func:`keywords` and ``plan()``'s options."""
    names = list(names)
    meant = (aliases or {}).get(value)
    return meant if meant in names else next(iter(difflib.get_close_matches(value, names, n=1)), None)
