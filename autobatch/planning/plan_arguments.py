"""plan()'s arguments: checked before any probe runs, each bad one a single error that names it.

Integers may be of any integer type (``numpy.int64`` from an array or a config): they are
read with :func:`~autobatch.checks.integer` and passed on as Python ints; ``bool`` and
``float`` are refused.
Switches must be real booleans: ``allow_accumulation="false"`` read as true and planned the
accumulation it meant to forbid, and ``balanced=None`` planned unbalanced micro-batches.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Iterable

from .. import checks
from ..probe.arguments import FIND_ALIASES

__all__ = ["check_switches", "validate", "validate_timing", "ragged_message", "smallest_batch", "check_one_step_cap",
           "check_option_names", "plan_keywords", "unknown_keyword", "OBJECTIVES"]

OBJECTIVES = ("max_batch", "throughput")
#: other names users give an objective, suggested where given
OBJECTIVE_ALIASES = {"speed": "throughput", "fastest": "throughput", "fast": "throughput", "samples_per_s": "throughput",
                     "max": "max_batch", "largest": "max_batch", "memory": "max_batch", "batch": "max_batch"}

#: probe_kwargs that are sizes: read as Python ints (their checks are find_max_batch's)
_SIZES = ("max_batch", "start", "multiple_of")


def check_switches(**switches: Any) -> None:
    """``ValueError`` unless every switch is ``True`` or ``False`` (``type(x) is bool``)."""
    for name, value in switches.items():
        if type(value) is not bool:
            raise ValueError(f"{name} must be True or False, got {type(value).__name__} {value!r:.60} (a string such "
                            "as 'false' would read as true, None as false: convert it to a bool first)")


def plan_keywords() -> frozenset[str]:
    """The keyword arguments ``plan()`` takes: its own and the ``find_max_batch()`` options it
    passes on (``**probe_kwargs``); a ``Runner``'s ``plan_options`` are among them."""
    from ..probe.find import find_max_batch
    from .planner import plan

    return frozenset(name for fn in (plan, find_max_batch) for name, parameter in inspect.signature(fn).parameters.items()
                     if parameter.kind is inspect.Parameter.KEYWORD_ONLY)


def unknown_keyword(key: str, known: Iterable[str]) -> str:
    """What to say of ``key``, no keyword argument of ``plan()`` or ``find_max_batch()``: the
    closest known name where one is close (``memory_limt``), and the names there are."""
    names = sorted(known)
    close = checks.closest(str(key), names, FIND_ALIASES)  # a peer's name too, as find_max_batch says
    guess = f"did you mean {close!r}? " if close else ""
    return f"is no keyword argument of plan() or find_max_batch(); {guess}use one of {', '.join(names)}"


def check_option_names(probe_kwargs: dict[str, Any]) -> None:
    """``plan(**probe_kwargs)``'s keys are ``find_max_batch()`` options; one ``TypeError`` naming
    ``plan()`` and the key otherwise, before any probe. A misspelt key (``memory_limt``) failed
    inside the first probe, as ``find_max_batch() got an unexpected keyword argument``, an
    error that named neither ``plan()`` nor the name meant."""
    known = plan_keywords()
    for key in probe_kwargs:
        if key not in known:
            raise TypeError(f"plan() got an unexpected keyword argument {key!r}: it {unknown_keyword(key, known)}")


def validate(step, global_batch, objective, probe_kwargs: dict[str, Any], min_micro_batch=None,
             **switches: Any) -> tuple[int, int | None]:
    """Check plan()'s own arguments (``switches``: its booleans, ``allow_accumulation`` among
    them); return ``global_batch`` and ``min_micro_batch`` as ints, and leave the integer
    ``probe_kwargs`` (``max_batch``, ``start``, ``multiple_of``) as ints."""
    check_option_names(probe_kwargs)
    check_switches(**switches)
    missing = [name for name in ("model", "optimizer", "loss_fn", "make_batch") if not hasattr(step, name)]
    if missing:
        plain = ("; plan() cuts a TrainStep's global batch into micro-batches of its loss_fn, which a plain callable "
                 "fn(batch_size) does not show: wrap the model, optimizer and loss in TrainStep(model, optimizer, loss_fn, "
                 "make_batch), or, for a step of several losses each stepping its own optimizer (a GAN), probe it with "
                 "find_max_batch(fn, restore=(gen, opt_g, disc, opt_d)) and accumulate in your own loop"
                 ) if callable(step) and len(missing) == 4 else ""
        raise TypeError(f"step must be an autobatch.TrainStep (it lacks {', '.join(missing)}), got {step!r}{plain}")
    global_batch = checks.positive_int("global_batch", global_batch)
    checks.choice("objective", objective, OBJECTIVES, aliases=OBJECTIVE_ALIASES)
    for name in _SIZES:
        if probe_kwargs.get(name) is not None and checks.integer(probe_kwargs[name]) is not None:
            probe_kwargs[name] = checks.integer(probe_kwargs[name])
    if "steps_per_trial" in probe_kwargs:  # here, not only in find_max_batch: a global batch probed alone
        # runs max(2, steps_per_trial) steps, which took 0 or True silently and None as a TypeError
        probe_kwargs["steps_per_trial"] = checks.positive_int("steps_per_trial", probe_kwargs["steps_per_trial"])
    max_batch, multiple_of, start = probe_kwargs.get("max_batch"), probe_kwargs.get("multiple_of", 1), probe_kwargs.get("start")
    max_batch = checks.positive_int("max_batch", max_batch, allow_none=True)  # any integer type, as find_max_batch takes
    if "max_batch" in probe_kwargs:
        probe_kwargs["max_batch"] = max_batch
    if min_micro_batch is not None:
        given, min_micro_batch = min_micro_batch, checks.integer(min_micro_batch)
        if min_micro_batch is None or min_micro_batch < 1:
            raise ValueError(f"min_micro_batch must be a positive integer or None (throughput: the smallest micro-batch "
                             f"timed), got {given!r}{checks.int_hint('min_micro_batch', given)}")
    if isinstance(start, int) and not isinstance(start, bool) and start > global_batch:
        raise ValueError(f"start={start} is larger than global_batch={global_batch}: the probes try micro-batches of at "
                         "most the global batch; lower start (or leave it out)")
    if isinstance(multiple_of, int) and not isinstance(multiple_of, bool) and multiple_of > global_batch:
        raise ValueError(f"global_batch={global_batch} is smaller than multiple_of={multiple_of}: no micro-batch of it "
                         "is a multiple; lower multiple_of or raise global_batch")
    if isinstance(multiple_of, int) and multiple_of > 1 and global_batch % multiple_of and (max_batch or global_batch) < global_batch:
        raise ValueError(ragged_message(global_batch, multiple_of, f"max_batch={max_batch} keeps it from one step"))
    check_one_step_cap(global_batch, max_batch, switches.get("allow_accumulation", True))
    return global_batch, min_micro_batch


def ragged_message(global_batch: int, multiple_of: int, why: str) -> str:
    """The error for a global batch that is not a multiple of ``multiple_of`` and cannot run in one step."""
    below = global_batch // multiple_of * multiple_of
    return (f"global_batch={global_batch} is not a multiple of multiple_of={multiple_of}, so its micro-batches cannot "
            f"all be multiples, and {why}; use a global_batch that is a multiple of {multiple_of} "
            f"({below} or {below + multiple_of}), or a multiple_of that divides {global_batch}{divisors_text(global_batch, multiple_of)}")


def divisors_text(global_batch: int, multiple_of: int) -> str:
    """The smaller ``multiple_of`` values that divide the global batch, for :func:`ragged_message` (and the
    runner's error, :func:`~autobatch.training.multiples.multiple_options`): a prime
    global batch (97) has none above 1, and "a multiple_of that divides 97" sent the user looking for one."""
    found = [size for size in range(multiple_of - 1, 1, -1) if global_batch % size == 0][:3]
    if len(found) > 1:
        return f" ({', '.join(map(str, found[:-1]))} or {found[-1]})"
    if found:
        return f" ({found[0]})"
    return f" (below {multiple_of}, only 1 does: multiple_of=1 puts no constraint on the sizes)"


def smallest_batch(probe_kwargs: dict[str, Any]) -> str:
    """The smallest batch a probe tries, for a plan's reason: ``batch 1``, or with ``multiple_of=N``
    ``batch N (multiple_of=N)`` (a plan at multiple_of=8 said "batch 1 does not fit" where 1 fitted)."""
    smallest = probe_kwargs.get("multiple_of", 1)
    return f"batch {smallest}" + (f" (multiple_of={smallest})" if smallest > 1 else "")


def check_one_step_cap(global_batch: int, max_batch: int | None, allow_accumulation: bool) -> None:
    """Without accumulation one step holds the global batch: a ``max_batch`` below it can never plan."""
    if not allow_accumulation and max_batch is not None and max_batch < global_batch:
        raise ValueError(f"max_batch={max_batch} is below global_batch={global_batch} and allow_accumulation=False: "
                         "one step must hold the whole global batch; raise max_batch or allow accumulation")


def validate_timing(*, warmup_steps: int, timed_steps: int, retime_rounds: int = 0,
                    retime_within: float = 0.0, timer: Callable[[], float] | None = None,
                    allocator_retries: Callable[[], int | None] | None = None) -> dict[str, int | float]:
    """Raise ``ValueError`` naming the first bad timing knob; else the knobs as plain Python
    numbers (a NumPy integer or float is taken, as everywhere else: a sweep's values often
    are), so the plan's report and JSON hold plain types. ``timer`` and ``allocator_retries``
    (None: the defaults) must be callables: a string failed as ``'str' object is not callable``
    after every probe had run."""
    if timer is not None:
        checks.function("timer", timer, "() -> seconds (e.g. time.perf_counter)")
    if allocator_retries is not None:
        checks.function("allocator_retries", allocator_retries, "() -> the allocator's cumulative retry count, or None")
    timing: dict[str, int | float] = {}
    counts = (("warmup_steps", warmup_steps, 0), ("timed_steps", timed_steps, 1), ("retime_rounds", retime_rounds, 0))
    for name, value, low in counts:  # the shared check: 4.0 or "4" is told "pass an int, e.g. timed_steps=4"
        timing[name] = checks.count(name, value, low=low)
    if isinstance(retime_within, bool) or not isinstance(retime_within, numbers.Real) or not 0 <= retime_within < 1:
        raise ValueError("retime_within must be a fraction in [0, 1) (0.1: within 10 % of the best), "
                         f"got {retime_within!r}")
    timing["retime_within"] = float(retime_within)
    return timing
