"""The checks of :func:`~autobatch.integrations.decorator.find_executable_batch_size`: its
arguments where it decorates, the call's where the wrapped function is called, and what the call
returned. Each bad input is one error naming what to change.

Where the batch size goes: first, as Accelerate passes it, except for a function defined as a
method (its first parameter named ``self`` or ``cls``), which gets it second, after the instance:
Accelerate passes a method's batch size as ``self`` and the instance as the batch size, so that
``self.model`` fails on an ``int`` far from the cause (:func:`is_method`).
"""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any, Callable

from ..checks import integer, positive_int
from ..memory.units import format_bytes

__all__ = ["caught_message", "retry_note", "check_arguments", "check_call", "check_reduce", "check_takes_batch", "is_method", "reduced_size", "refuse_coroutine"]

#: the first parameter's names that make a function a method: the batch size goes second
METHOD_FIRST = ("self", "cls")


def is_method(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a plain function written as a method (``def train(self,
    batch_size)`` in a class body): its first parameter is named ``self`` or ``cls``. A bound
    method (``trainer.train``) is not: its instance is bound already, the batch size is first."""
    if not inspect.isfunction(function):
        return False
    params = list(inspect.signature(function).parameters.values())
    return len(params) >= 2 and params[0].name in METHOD_FIRST and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def refuse_coroutine(function: Callable[..., Any], value: Any) -> None:
    """A callable that returned a coroutine (a sync wrapper of an ``async def``, which the
    decoration-time check cannot see) or a generator (``return loop(batch_size)`` where ``loop``
    yields) has not run its steps: refuse it, closing what it returned. Why the generator: its
    steps ran while the caller iterated, after the retry returned, so an out-of-memory error
    escaped it and the size was recorded as one that ran."""
    name = getattr(function, "__name__", "function")
    if inspect.iscoroutine(value):
        value.close()
        raise TypeError(
            f"find_executable_batch_size cannot retry `{name}`: it "
            "returned a coroutine, whose steps run when it is awaited, after the retry returned; "
            "decorate a synchronous function that trains (run the loop with asyncio.run inside it)"
        )
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        if inspect.isgenerator(value):  # an async generator not started holds nothing
            value.close()
        raise TypeError(
            f"find_executable_batch_size cannot retry `{name}`: it returned a generator, whose steps run while "
            "the caller iterates, after the retry returned, so an out-of-memory error there escapes it; run the "
            f"loop inside `{name}` and return what it yields as a list (return list(loop(batch_size)))"
        )


def check_arguments(start: int, factor: float, multiple_of: int, function: Any, reduce: Any = None) -> tuple[int, int]:
    """One error for a bad argument of the decorator, naming it (``reduce``: :func:`check_reduce`);
    ``(start, multiple_of)`` as plain ints. Any integer type is taken (``np.int64(64)``, as Accelerate's decorator and
    :func:`~autobatch.checks.positive_int` take it; it was refused as "not a positive integer")."""
    start = positive_int("starting_batch_size", start)
    check_reduce(reduce)
    multiple_of = positive_int("multiple_of", multiple_of)
    if not isinstance(factor, (int, float)) or not 0 < factor < 1:
        raise ValueError(f"fallback_factor must be a number between 0 and 1 (exclusive), got {factor!r}")
    if start < multiple_of:
        raise ValueError(
            f"starting_batch_size {start} is below multiple_of {multiple_of}: no size from it down is a "
            f"multiple; start at {multiple_of} or more, or pass a smaller multiple_of"
        )
    if isinstance(function, int) and not isinstance(function, bool):  # @find_executable_batch_size(64)
        raise TypeError(
            f"find_executable_batch_size({function}) took {function} for the function to decorate: pass the size "
            f"by name, @find_executable_batch_size(starting_batch_size={function})"
        )
    if not callable(function):
        raise TypeError(f"find_executable_batch_size decorates a function; got {type(function).__name__}")
    name = getattr(function, "__name__", "function")
    if inspect.iscoroutinefunction(function):
        raise TypeError(
            f"find_executable_batch_size cannot retry the coroutine function `{name}`: calling it returns a "
            "coroutine whose steps run when it is awaited, after the call returned, so an out-of-memory error "
            "there escapes the retry; decorate a synchronous function that trains (run the loop with "
            "asyncio.run inside it)"
        )
    if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
        raise TypeError(
            f"find_executable_batch_size cannot retry the generator `{name}`: its steps run while the caller "
            "iterates, after the call returned, so an out-of-memory error there escapes the retry; decorate a "
            "function that trains and returns (collect what it yields in a list)"
        )
    return start, multiple_of


def check_reduce(reduce: Any) -> None:
    """One ``TypeError`` where it decorates, for a ``reduce_batch_size_fn`` that is not a callable
    of no arguments (Accelerate calls it as ``reduce_batch_size_fn()``). Why: ``lambda bs: bs // 2``
    or a factor (``reduce_batch_size_fn=0.5``) was accepted and failed only after the first
    out-of-memory error, with Python's ``missing 1 required positional argument: 'bs'`` or
    ``'float' object is not callable``, naming neither the decorator nor what to change."""
    if reduce is None:
        return
    if not callable(reduce):
        factor = " (to shrink by a factor, pass fallback_factor=)" if isinstance(reduce, (int, float)) else ""
        raise TypeError(f"reduce_batch_size_fn must be a function of no arguments that returns the next batch "
                        f"size, got {reduce!r:.40}{factor}")
    try:
        inspect.signature(reduce).bind()
    except TypeError:
        raise TypeError(
            f"reduce_batch_size_fn {getattr(reduce, '__name__', reduce)!s:.40} must take no arguments (it is called as "
            "reduce_batch_size_fn(), as Accelerate calls it): read the size that failed from the decorated function's "
            "batch_size, reduce_batch_size_fn=lambda: train.batch_size // 2"
        ) from None
    except ValueError:
        return  # a builtin without a signature: the call says


def reduced_size(value: Any) -> int:
    """What a ``reduce_batch_size_fn`` returned, as an ``int``: a number is floored (``train.batch_size
    / 2`` or ``* 0.8`` gives a float), anything else is one ``TypeError`` naming the hook. Why: a hook
    that forgot its ``return`` failed with ``int() argument must be ... not 'NoneType'``, and one
    that returned a string (``"4"``) was taken as a size."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and integer(value) is None:
        raise TypeError(f"reduce_batch_size_fn returned {value!r:.40}; it must return the next batch size as an int "
                        "(does it `return` it?)")
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"reduce_batch_size_fn returned {value!r}; it must return the next batch size as an int")
    return int(value) if integer(value) is None else integer(value)


def check_takes_batch(function: Callable[..., Any], method: bool) -> None:
    """One ``TypeError`` where it decorates, for a function with no positional parameter for the
    batch size (``def train(*, batch_size)``, ``def train()``). Why: the decorator passes the size
    positionally, as Accelerate's does, so the first call failed inside the first attempt with
    Python's "takes 0 positional arguments but 1 was given", naming neither the decorator nor
    what to change."""
    try:
        params = list(inspect.signature(function).parameters.values())[int(method):]
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call says
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)
    name = getattr(function, "__name__", "function")
    slot = next((p for p in params if p.kind in positional), None)
    if slot is not None:
        _check_slot(name, params, slot, method)
        return
    keyword = next((p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and "batch" in p.name), None)
    where = f"`{keyword}` is keyword-only there: move it before the `*`" if keyword else (
        "add it as the first parameter")
    raise TypeError(
        f"find_executable_batch_size passes the batch size to `{name}` as its first positional argument"
        f"{' (after the instance)' if method else ''}, and `{name}` takes none: {where}, "
        f"def {name}({'self, ' if method else ''}batch_size, ...)"
    )


def _check_slot(name: str, params: list[inspect.Parameter], slot: inspect.Parameter, method: bool) -> None:
    """One ``TypeError`` where a parameter named ``batch_size`` is not the one the size goes to
    (``def train(model, batch_size)``, ``def train(model, *, batch_size)``). Why: the size went to
    ``model`` and the caller's model to ``batch_size`` (or nothing to it), and the first attempt
    failed far from the cause (``'int' object is not callable``, a ``DataLoader`` given a module as
    its batch size), or ran with the parameter's default size, never the one tried."""
    named = next((p for p in params if p.name == "batch_size"), None)
    if named is None or named is slot:
        return
    takes = f"`*{slot.name}`" if slot.kind is inspect.Parameter.VAR_POSITIONAL else f"`{slot.name}`"
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    others = ", ".join(stars.get(p.kind, "") + p.name for p in params if p is not named)
    raise TypeError(
        f"find_executable_batch_size passes the batch size to `{name}` as its first positional argument"
        f"{' (after the instance)' if method else ''}, which `{name}` names {takes}, not `batch_size`: `batch_size` "
        f"would not get it. Make batch_size the first parameter, def {name}({'self, ' if method else ''}batch_size"
        f"{', ' + others if others else ''})"
    )


def check_call(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], method: bool) -> None:
    """Accelerate's guard, by position and by name: the caller must not pass the batch size
    itself (by name Python would only say it got "multiple values" for it). ``args`` are the
    call's own (a method's without its instance)."""
    try:
        params = list(inspect.signature(function).parameters.values())[int(method):]
    except (TypeError, ValueError):
        return
    name = getattr(function, "__name__", "function")
    if params and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and params[0].name in kwargs:
        raise TypeError(
            f"Batch size was passed into `{name}` by name ({params[0].name}={kwargs[params[0].name]!r}). Remove "
            "it: the decorator supplies it (start elsewhere with starting_batch_size=)"
        )
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    # keyword-only parameters and **kwargs take no position: `def train(batch_size, model, *, lr)`
    # called as train(64, model) would get Python's "takes 2 positional arguments but 3 were given"
    params = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(params) < len(args) + 1:
        if args and not _looks_like_size(args[0]):  # the function has no parameter for it: `def train(model)`
            raise TypeError(_no_slot_message(name, params, args[0], method))
        names = ", ".join(p.name for p in params[1:len(args)])
        raise TypeError(
            f"Batch size was passed into `{name}` as the first argument when called. Remove it: the "
            f"decorator supplies it: `{name}({names})`"
        )


def _looks_like_size(value: Any) -> bool:
    """Whether a call's first argument could be a batch size the caller passed (an int, a NumPy
    integer, an integer scalar tensor), not one of the function's own arguments."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _no_slot_message(name: str, params: list[inspect.Parameter], first: Any, method: bool) -> str:
    """The error for a call whose arguments fill every positional parameter, the first not a size:
    the function was written without the batch size (``def train(model, optimizer)``, called
    ``train(model, optimizer)``). Why: the error said the batch size was passed and to remove it
    (``train(optimizer)``), and the call it advised gave the size to ``model``: ``'int' object is
    not callable``, far from the cause."""
    names = ", ".join(p.name for p in params)
    return (
        f"find_executable_batch_size passes the batch size to `{name}` as its first positional argument"
        f"{' (after the instance)' if method else ''}, but the call's arguments fill all of `{name}`'s positional "
        f"parameters ({names}), and its first argument is a {type(first).__name__}, not a batch size: add the batch "
        f"size as `{name}`'s first parameter, def {name}({'self, ' if method else ''}batch_size, {names}), and keep "
        "the call as it is"
    )


def caught_message(name: str, size: int, caught: int) -> str:
    """The warning for a call that returned after catching out-of-memory errors itself. Why the
    second remedy: wrapped around ``Trainer.train()`` under ``auto_find_batch_size=True``, the call
    returned 32 after 6 errors that Transformers' own retry caught (it trained at 15, from step 0),
    and the advice to re-raise them named code the user does not own."""
    return (
        f"find_executable_batch_size: `{name}` returned at batch {size}, but {caught} out-of-memory error(s) "
        f"were raised inside it and caught there (by an except in the function, not by this decorator), so batch "
        f"{size} was not retried smaller and is where the next call starts; the steps that ran out of memory did "
        "not train. Let out-of-memory errors leave the function (in a broad except: `if autobatch.is_oom_error(exc): "
        "raise`). Where a retry inside it caught them (Transformers' TrainingArguments(auto_find_batch_size=True), "
        "Accelerate's find_executable_batch_size), it trained at a smaller size than this one, restarting from its "
        "first step: keep one of the two (auto_find_batch_size=False, or drop this decorator)"
    )


def retrained_message(name: str, steps: int, size: int) -> str:
    """The warning for a call whose failed attempts stepped an optimizer that the attempt which ran
    stepped again, with no checkpoint loaded into it
    (:class:`~autobatch.integrations.decorator_state.RetrainedSteps`)."""
    return (
        f"find_executable_batch_size: before `{name}` ran at batch {size}, its failed attempts took {steps} optimizer "
        f"step(s) with an optimizer that batch {size} stepped again (one made before the call); the model keeps "
        f"those updates, and each retry ran `{name}` from its top without loading a state dict into that optimizer, "
        "so the samples of those steps were trained twice (and a learning-rate scheduler made outside stepped on). "
        "Build the model and optimizer inside the function (Accelerate's pattern), or resume inside it from your "
        "last checkpoint (model.load_state_dict, optimizer.load_state_dict)"
    )


def accumulation_message(name: str, start: int, size: int, before: int, after: int) -> str:
    """The warning for a call that ran at a smaller size than it started at while an
    ``accelerate.Accelerator`` accumulated gradients: the samples per optimizer step changed.
    Why: ``Accelerator(gradient_accumulation_steps=4)`` with a start of 64 asks for 256 samples a
    step; Accelerate's decorator lowers the micro-batch and keeps the accumulation, so the
    learning rate tuned for 256 silently met fewer (as Transformers' ``auto_find_batch_size``,
    transformers#33281). Where the size does not divide the samples asked, it names a halving retry
    too: a function that already set the accumulation from its size (the docs' recipe) was told only
    to do what it did."""
    wanted = start * before
    fix = (f"set `accelerator.gradient_accumulation_steps = {wanted} // batch_size` at the top of `{name}` (where "
           f"`{name}` makes its Accelerator, `Accelerator(gradient_accumulation_steps={wanted} // batch_size)`)")
    if wanted % size:
        fix += (f" and, as {size} does not divide {wanted}, pass `reduce_batch_size_fn=lambda: {name}.batch_size // 2` "
                f"so that every size tried divides it")
    return (
        f"find_executable_batch_size: `{name}` ran at batch {size} where this call started at {start}, with the "
        f"Accelerator accumulating {after} micro-batch(es) a step (gradient_accumulation_steps), so each optimizer "
        f"step trains {size * after} samples per process where {start} x {before} = {wanted} were asked, and a "
        f"learning rate tuned for {wanted} no longer matches. To keep {wanted}, {fix}, or scale the learning rate "
        "to the new batch"
    )


def kept_by_failures(name: str, attempts: list[Any]) -> str | None:
    """What to change where the memory in use when this call's attempts started never fell and rose
    after at least two failed attempts (by 5 % of the capacity in all), or None. Why: an Accelerator
    made outside that ``prepare()``s the model and optimizer inside the function keeps every
    attempt's, so each retry starts with less memory; the search ended at batch 1 with
    ``NoBatchFitsError`` advising gradient accumulation (an MLP under 3 MiB: 12 attempts, each
    starting 276 KiB higher), or answered a size far below what fits, silently."""
    starts = [attempt.start_bytes for attempt in attempts]
    capacity = attempts[-1].capacity_bytes if attempts else None
    if len(starts) < 3 or capacity is None or any(start is None for start in starts):
        return None
    rises = [after - before for before, after in zip(starts, starts[1:])]
    if any(rise < 0 for rise in rises) or sum(rise > 0 for rise in rises) < 2 or starts[-1] - starts[0] < 0.05 * capacity:
        return None
    return (
        f"The memory in use when each attempt of `{name}` started rose after its failed attempts, from "
        f"{format_bytes(starts[0])} to {format_bytes(starts[-1])} of {format_bytes(capacity)} at batch "
        f"{attempts[-1].batch_size}: something outside `{name}` keeps what its failed attempts made, so each retry "
        "had less memory. An accelerate.Accelerator that prepare()s a model and optimizer inside the function keeps "
        "every one: call accelerator.free_memory() at the top of the function (Accelerate's pattern); otherwise "
        "let go of what the function stores outside itself (a list or cache of tensors)."
    )


def retry_note(name: str, attempts: list[Any], steps: int) -> str:
    """The note on an error that is not out-of-memory, raised by a retry (``attempts``: this call's,
    the last the one that raised it; ``steps``: those its failed attempts took with optimizers
    still alive). Why: a ``OneCycleLR`` made outside the function stepped on through a failed
    attempt's steps, and the retry raised torch's "Tried to step 41 times. The specified number of
    total steps is 40", with nothing saying that a retry ran or why the schedule had run out."""
    failed = [attempt.batch_size for attempt in attempts[:-1] if not attempt.ok]
    sizes = ", ".join(str(size) for size in failed)
    stepped = (f"; they took {steps} optimizer step(s), which a learning-rate scheduler made outside counted too "
               "(a OneCycleLR then runs past its total_steps: \"Tried to step\")" if steps else "")
    return (
        f"autobatch: find_executable_batch_size's retry of `{name}` at batch {attempts[-1].batch_size} raised this, "
        f"after {len(failed)} attempt(s) ran out of memory (batch {sizes}){stepped}. Each retry runs `{name}` from "
        f"its top, but what was made outside it keeps what the failed attempts did (a scheduler's step count, an "
        f"iterator's position): make the optimizer, scheduler and data iterators inside `{name}`, or load their "
        "state dicts at its top"
    )
