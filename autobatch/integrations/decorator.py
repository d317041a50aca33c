"""``find_executable_batch_size``: a drop-in for Accelerate's decorator that measures.

Accelerate's decorator calls ``function(batch_size, *args, **kwargs)`` and, on an
out-of-memory error, multiplies the size by 0.9 and calls again. Three things differ here:

* **Memory is freed outside the ``except`` block** (and at each call's start under Accelerate's mixed
  precision: :func:`~.decorator_accelerate.collect_mixed_precision`). While an exception is handled its
  traceback pins every frame of the failed call, and with them its activations, so the
  ``gc.collect()`` / ``empty_cache()`` Accelerate runs inside the handler frees nothing they
  hold (pytorch/pytorch#18853). Here the handler only records the failure; the failed call's
  frames are gone before memory is freed and the next size starts.
* **The next size comes from what the failed attempt measured, where that says more than
  ×0.9.** Before each attempt the memory in use is noted; at a failure, the memory allocated
  then (as the error message says it, or as the failed frames still hold it until the handler
  is left) plus the allocation that failed is a lower bound on what the size needed (the attempt's peak is not: it may have come
  earlier and been freed), and scaling the size by ``(usable - in use) / (needed -
  in use)`` is the largest size that bound allows. It is a *lower* bound: it helps when the
  failing allocation was large (a far too large start failing in one big activation jumps
  down at once); a step that failed late, near its end, bounds its need barely above the
  capacity. The next size is the smaller of that and ``fallback_factor`` × the size (0.9,
  Accelerate's); where the bound allows more, once a call, half that step (×0.95: it lands
  closer, at most one attempt more than Accelerate; :mod:`.decorator_steps`). Without
  instruments (the CPU outside :func:`~autobatch.simulated_memory`, MPS) it is the fallback. Only the successful
  call's size is known to run, so like Accelerate's the search only goes down; for the exact
  largest size in a few trials, probe a step with :func:`~autobatch.find_max_batch` first.
* **Every attempt is recorded** in ``wrapped.attempts`` (size, outcome, peak, the failed
  allocation, seconds, how the next size was chosen), and the size that ran is
  ``wrapped.batch_size``. As in Accelerate, a later call starts from the last size that ran.
* **A failed attempt's gradients are dropped, and only those.** Its backward pass may have run
  before the OOM (a metric buffer after ``backward()``, an optimizer step that ran out of
  memory): its gradients would stay on the parameters, so the next attempt's step would apply
  the sum of several backward passes, and their bytes would shrink the next size. At each
  attempt's start the gradient of every parameter of every optimizer that was live at the
  process's first decorated call or has stepped since is noted (the tensor,
  weakly, and its ``_version`` counter: nothing copied); after a failure (never after a call
  that ran) a gradient the attempt created is set to None, as ``zero_grad(set_to_none=True)``
  does, and one it left alone is kept: a training loop half-way through an accumulation window
  that calls a decorated inference helper keeps its gradients. A gradient that existed and the
  failed attempt changed in place (its backward added into it) cannot be put back without a
  copy: it is set to None too, with one ``RuntimeWarning`` saying that the gradients accumulated
  before the call were lost. Gradients of parameters no optimizer alive at the failure holds stay
  (one made inside the function over a model made outside is found in the ``except`` handler,
  before it dies with the failed frames; its model's gradients were kept). A ``GradScaler``
  forgets the ``unscale_`` of an optimizer whose gradients were dropped (the next attempt's
  ``unscale_``, fp16 with gradient clipping, raised "already been called"), and an
  ``accelerate.Accelerator``'s micro-batch counter is put back (the next attempt's accumulation
  windows were shifted): :mod:`.decorator_state`.

Errors that are not out-of-memory propagate unchanged (the table of
:func:`~autobatch.is_oom_error`, wider than Accelerate's); one a retry raised carries a note
naming the failed attempts before it, and the optimizer steps they took with optimizers made
outside (a ``OneCycleLR`` made outside ran past its ``total_steps`` on them: "Tried to step"). When batch 1 fails,
:class:`~autobatch.NoBatchFitsError` (a ``MemoryError``; Accelerate raises a ``RuntimeError``)
is raised from the last allocator error, with the figures.
A call that returns after out-of-memory errors were raised and caught inside the function (its
own ``except``; the device's counter says so) is one ``RuntimeWarning``: no retry saw them, and the
size would otherwise pass for one that ran (``Attempt.caught_ooms``).
A call that returns after its failed attempts stepped an optimizer that the attempt which ran
stepped again (one passed in: each retry runs the function from its top, and the model keeps
the failed attempts' updates), with no ``load_state_dict`` into it since (a loop that resumes from
its own checkpoint), is one ``RuntimeWarning`` saying how many steps' samples were trained twice.
The wrapper reaches itself through a weak reference: naming itself in its own closure was a cycle,
so it, the user's function and what that closes over (a model built in ``main()``, the Accelerate
pattern) outlived the last reference until the garbage collector's next full collection (review 38).
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ..errors import add_note
from ..memory.devices import AcceleratorMemory, DeviceMemory, SimulatedDeviceMemory, resolve_device
from ..memory.diagnostics import caught_since, oom_mark
from ..memory.lazy_state import LazyStateWatch
from ..memory.oom import allocated_at_failure, free_memory, is_oom_error, recognised_ooms, requested_bytes
from ..memory.simulated import active_simulation
from .decorator_loaders import KeptLoader
from .decorator_checks import (accumulation_message, caught_message, check_arguments, check_call,
                               check_takes_batch, is_method, kept_by_failures, reduced_size, refuse_coroutine,
                               retrained_message, retry_note)
from .decorator_fixed import FIXED, fixed_point, fixed_step
from .decorator_accelerate import accumulation_steps, collect_mixed_precision
from .decorator_state import AttemptState
from .decorator_steps import next_size
from .decorator_stop import fixed_failure, nothing_fits

__all__ = ["find_executable_batch_size", "Attempt"]



@dataclass
class Attempt:
    """One call of the wrapped function at ``batch_size``."""

    batch_size: int
    ok: bool
    seconds: float
    #: bytes in use when the attempt started (after the function's own ``accelerator.free_memory()``),
    #: the peak it reached, and those allocated when it failed (None without instruments)
    start_bytes: int | None = None
    peak_bytes: int | None = None
    failed_at_bytes: int | None = None
    #: the allocation that failed, read from the error message (None when it does not say)
    requested_bytes: int | None = None
    capacity_bytes: int | None = None
    error: str | None = None
    #: the size tried next and why: "measured" (allocated at the failure + the request), "fallback" (× fallback_factor),
    #: "finer" (half its step, once a call, where the measured bound allowed more), "fixed_point" (past failures
    #: at one point whose memory barely shrinks with the size: :mod:`.decorator_fixed`) or "reduce_batch_size_fn"
    next_batch_size: int | None = None
    next_from: str | None = None
    #: out-of-memory errors raised during a call that returned and caught inside the function (by
    #: its own ``except``, not by a nested decorated call): the size may not have run its steps
    caught_ooms: int = 0
    #: the attempt was interrupted (Ctrl-C's ``KeyboardInterrupt``, a ``SystemExit``, or an error that is not
    #: out-of-memory, each re-raised unchanged) before it returned or ran out of memory: neither a size that ran
    #: nor a failure the search learned from (``ok`` False, ``error`` None)
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    device: str | torch.device | None = None,
    fallback_factor: float = 0.9,
    multiple_of: int = 1,
):
    """Call ``function(batch_size, *args, **kwargs)``, retrying smaller after an out-of-memory error.

    Use as ``@find_executable_batch_size`` or ``@find_executable_batch_size(starting_batch_size=64)``; call the wrapped
    function without the batch size. A method (``self`` or ``cls`` first) gets it after the instance, as Accelerate's.
    ``reduce_batch_size_fn()`` (Accelerate's hook) overrides how the next size is chosen; its
    answer is rounded down to a multiple of ``multiple_of`` (where it is at least
    ``multiple_of``) and must be below the size that failed. ``device``: whose memory is measured
    (default: the current accelerator, else the CPU, measured only under ``simulated_memory``);
    ``fallback_factor``: the shrink when nothing was measured; ``multiple_of``: every size tried
    is a multiple of it (while it is at least ``multiple_of``): a start that is not is rounded
    down to one (100 with 8 starts at 96), and a start below ``multiple_of`` is a ``ValueError``
    rather than a size larger than asked. The wrapper has ``attempts`` (every :class:`Attempt`,
    over all calls) and ``batch_size`` (the size the next call starts from: the last that ran; after a
    ``NoBatchFitsError``, a Ctrl-C or another error, where that call started: :func:`_interrupted`). Over ``@staticmethod``/``@classmethod`` too.

    Raises:
        TypeError: the batch size was passed in the call, by position or name, or as the function
            (``@find_executable_batch_size(64)``); the function takes no positional parameter for it
            (``def train(*, batch_size)``) or has a ``batch_size`` that is not first (``def train(model,
            batch_size)``); it is a generator or ``async def``, or returns a coroutine or generator (its
            steps would run after the call returned, where no retry sees an out-of-memory error).
        ValueError: a bad argument, ``starting_batch_size`` below ``multiple_of``, or a ``reduce_batch_size_fn``
            that returned a size not below the one that failed (the retries would never end; one not a function
            of no arguments, or that returned no number, is a ``TypeError``).
        NoBatchFitsError: batch 1 ran out of memory; or sizes down to half the start failed at one
            point, whatever their size (a function that ignores it): the message says so.

    A failed attempt's own gradients are dropped; its optimizer steps and a retry's other error: module docstring.
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn, device=device,
                                 fallback_factor=fallback_factor, multiple_of=multiple_of)
    if isinstance(function, (staticmethod, classmethod)):  # under the decorator: wrap what it holds
        return type(function)(find_executable_batch_size(function.__func__, starting_batch_size, reduce_batch_size_fn,
                                                         device=device, fallback_factor=fallback_factor, multiple_of=multiple_of))
    starting_batch_size, multiple_of = check_arguments(starting_batch_size, fallback_factor, multiple_of, function,
                                                       reduce_batch_size_fn)  # and the hook's signature
    check_takes_batch(function, method := is_method(function))  # where the size goes, and that it can

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        check_call(function, args[int(method):], kwargs, method)
        collect_mixed_precision()  # a last call's bf16 model (a cycle) failed this call's start
        memory = _instruments(device)
        with LazyStateWatch() as watch, AttemptState(memory, getattr(function, "__name__", "function")) as state:
            return _attempts(itself(), watch, memory, state, args, kwargs)  # alive: it is being called

    def _attempts(wrapped: Any, watch: LazyStateWatch, memory: DeviceMemory | None, grads: AttemptState,
                  args: tuple, kwargs: dict) -> Any:
        first, mine, accumulating = wrapped.batch_size, len(wrapped.attempts), accumulation_steps()  # x first: asked
        kept = KeptLoader(getattr(function, "__name__", "function"), args[int(method):], kwargs, function, *args[:int(method)])
        began = time.perf_counter()
        try:
            while True:
                size = wrapped.batch_size
                attempt = Attempt(batch_size=size, ok=False, seconds=0.0)
                wrapped.attempts.append(attempt)
                grads.record(size)
                if memory is not None:
                    memory.synchronize()
                    memory.reset_peak()
                    attempt.start_bytes, attempt.capacity_bytes = memory.allocated(), memory.capacity()
                mark = oom_mark(memory)
                began = time.perf_counter()
                try:
                    value = function(*args[:1], size, *args[1:], **kwargs) if method else function(size, *args, **kwargs)
                except Exception as exc:
                    if not is_oom_error(exc):
                        _note_retry(exc, function, wrapped.attempts[mine:], grads)
                        raise
                    _record_failure(attempt, exc, memory, began, grads, kept)
                    if size <= 1 or fixed_failure(wrapped.attempts[mine:]) == "stop":  # a smaller size fails too
                        wrapped.batch_size = first  # nothing ran: a later call (memory freed since) searches again
                        raise nothing_fits(attempt, memory, wrapped.attempts[mine:], function,
                                           args[0] if method else None, kept.message) from exc
                    # leave the handler: only the message is kept, the failed frames are released
                else:
                    refuse_coroutine(function, value)
                    attempt.seconds, attempt.ok = time.perf_counter() - began, True
                    _returned(wrapped.attempts[mine:], function, memory, mark, (grads, kept), accumulating)
                    return value
                _undo_failed(attempt, watch, grads, memory, getattr(function, "__name__", "function"))
                wrapped.batch_size = _next_size(wrapped.attempts[mine:], reduce_batch_size_fn, fallback_factor, multiple_of)
        except BaseException:  # Ctrl-C (KeyboardInterrupt), SystemExit, another error: re-raised unchanged
            _interrupted(wrapped, wrapped.attempts[mine:], first, (time.perf_counter() - began, grads))
            raise

    wrapped.attempts, itself = [], weakref.ref(wrapped)  # type: ignore[attr-defined]  # weakly: module docstring
    wrapped.batch_size = starting_batch_size - starting_batch_size % multiple_of  # type: ignore[attr-defined]
    return wrapped


def _returned(attempts: list[Attempt], function: Callable[..., Any], memory: DeviceMemory | None,
              mark: tuple[int, int] | None, state: tuple[AttemptState, KeptLoader], accumulating: int) -> None:
    """A call that returned: its peak, and one ``RuntimeWarning`` where the device counted
    out-of-memory errors during it beyond those nested decorated calls handled: the function
    caught them itself (an ``except Exception`` around its loop, a per-batch ``except`` that skips the batch), so the
    retry never saw them and the size is recorded as one that ran. Why: that size was kept as
    ``wrapped.batch_size`` for the next call, with no sign that steps (and their samples) were
    skipped. Then :func:`_smaller_than_asked`. ``attempts``: this call's, the last the one that ran;
    ``mark``: the out-of-memory counts at its start (:func:`~autobatch.memory.diagnostics.oom_mark`). A prepared loader
    made outside that trained at its own size is one warning (:meth:`~.decorator_loaders.KeptLoader.returned`)."""
    attempt, (grads, kept) = attempts[-1], state
    kept.returned(attempt.batch_size)
    attempt.start_bytes = grads.started(attempt.start_bytes)  # after the function's own free_memory()
    _smaller_than_asked(function, attempts, accumulating, grads)
    grads.resume.returned(stacklevel=5)  # the attempt that ran skipped other figures than the warning's
    if twice := grads.retrained.twice():
        warnings.warn(retrained_message(getattr(function, "__name__", "function"), twice, attempt.batch_size),
                      RuntimeWarning, stacklevel=4)
    if memory is not None:
        attempt.peak_bytes = memory.peak()
    caught = caught_since(memory, mark)
    if caught is None:
        return
    attempt.caught_ooms = caught
    if attempt.caught_ooms:
        recognised_ooms(attempt.caught_ooms)  # warned here: an enclosing decorated call does not again
        warnings.warn(caught_message(getattr(function, "__name__", "function"), attempt.batch_size,
                                     attempt.caught_ooms), RuntimeWarning, stacklevel=4)


def _smaller_than_asked(function: Callable[..., Any], attempts: list[Attempt], accumulating: int,
                        grads: AttemptState) -> None:
    """After a call that ran at ``attempts[-1]`` (this call's attempts): one ``RuntimeWarning`` where
    memory its failed attempts left behind made the size smaller than the device allows
    (:func:`~.decorator_checks.kept_by_failures`), and one where an Accelerator's accumulation
    (the first attempt's, else ``accumulating`` micro-batches at the call's start) no longer makes
    the samples per optimizer step asked for (:func:`~.decorator_checks.accumulation_message`)."""
    name, first, size = getattr(function, "__name__", "function"), attempts[0].batch_size, attempts[-1].batch_size
    if kept := kept_by_failures(name, attempts):
        warnings.warn(f"find_executable_batch_size: {kept} Batch {size} is smaller than the device allows.",
                      RuntimeWarning, stacklevel=5)  # here, _returned, _attempts, wrapped: the caller's line
    accumulating = grads.first_accumulation or accumulating  # set by the function from its size, at its top
    now = accumulation_steps(live=not grads.accelerated)  # the shared state of an Accelerator made inside counts
    if (size < first and grads.retrained.stepped() and accumulating > 1 and now > 1
            and size * now != first * accumulating):  # it trains, accumulating, other samples a step
        warnings.warn(accumulation_message(name, first, size, accumulating, now), RuntimeWarning, stacklevel=5)


def _undo_failed(attempt: Attempt, watch: LazyStateWatch, grads: AttemptState, memory: DeviceMemory | None,
                 name: str) -> None:
    """After a failed ``attempt``, out of its handler: what it left half-made or on the parameters is
    undone (:meth:`~.decorator_state.AttemptState.drop_failed`), memory is freed, and its peak read."""
    watch.repair()  # an optimizer step the OOM interrupted leaves no half-created state
    if lost := grads.drop_failed():  # the next attempt neither steps with nor holds the failed one's
        warnings.warn(_lost_message(lost, name), RuntimeWarning, stacklevel=4)  # here, _attempts, wrapped: the caller
    free_memory()
    if memory is not None:
        attempt.peak_bytes = memory.peak()


def _interrupted(wrapped: Any, attempts: list[Attempt], first: int, running_for: tuple[float, AttemptState]) -> None:
    """A call that raises (Ctrl-C's ``KeyboardInterrupt``, a ``SystemExit``, an error that is not
    out-of-memory, a ``NoBatchFitsError``; ``attempts``: the call's own, ``first``: where it
    started; ``running_for``: the seconds since the last attempt began, and the call's
    :class:`~.decorator_state.AttemptState`): the attempt running then, if it neither returned nor ran
    out of memory, is marked ``interrupted``, and where none of the call's attempts ran, the next call
    starts where this one did, as after a ``NoBatchFitsError``, unless the interrupted attempt stepped
    an optimizer: its steps ran at its size (a run stopped by hand, or by a bad batch, after training a
    while), and a later call that resumes from its checkpoint skips its batches at that size. Why:
    ``wrapped.batch_size`` kept the size of an attempt that nothing had tested (128 ran out of memory,
    115 was interrupted, or raised a ``ValueError``, before a step, and the next call started at 115 as
    if 115 had run)."""
    (seconds, grads), running = running_for, attempts[-1] if attempts and not attempts[-1].ok and attempts[-1].error is None else None
    if running is not None:
        running.interrupted, running.seconds = True, seconds
    if not any(attempt.ok for attempt in attempts) and (running is None or not grads.retrained.stepped()):
        wrapped.batch_size = first


def _note_retry(exc: Exception, function: Callable[..., Any], attempts: list[Attempt], grads: AttemptState) -> None:
    """A note on an error that is not out-of-memory where a retry raised it (``attempts``: this
    call's, the last the one that raised it): the failed attempts before it may be its cause."""
    if len(attempts) > 1:
        add_note(exc, retry_note(getattr(function, "__name__", "function"), attempts, grads.retrained.taken_total()))


def _record_failure(attempt: Attempt, exc: Exception, memory: DeviceMemory | None, began: float,
                    grads: AttemptState, kept: KeptLoader) -> None:
    """The failed attempt's figures, read in the handler, while the failed frames still hold what
    they allocated (the message's figure where it says more), and the objects they hold that
    :meth:`~.decorator_state.AttemptState.drop_failed` needs (an optimizer made inside), and the
    prepared loader it was iterating (:class:`~.decorator_loaders.KeptLoader`)."""
    grads.note_failure()
    kept.failed(attempt.batch_size)
    attempt.start_bytes = grads.started(attempt.start_bytes)  # after the function's own free_memory()
    if memory is not None:
        attempt.failed_at_bytes = max(memory.allocated(), allocated_at_failure(str(exc)) or 0)
    attempt.seconds = time.perf_counter() - began
    attempt.error = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    attempt.requested_bytes = requested_bytes(str(exc))


def _next_size(attempts: list[Attempt], reduce: Callable[[], int] | None, factor: float, multiple_of: int) -> int:
    attempt = attempts[-1]
    size = attempt.batch_size
    if reduce is not None:
        asked, how = reduced_size(reduce()), "reduce_batch_size_fn"
        if asked < 1:
            raise ValueError(f"reduce_batch_size_fn returned {asked}; it must return a positive batch size")
        chosen = asked - asked % multiple_of if asked >= multiple_of else asked  # a multiple, as the fallback's
        if chosen >= size:  # the same size again would fail again, for ever
            rounded = f" (rounded down to {chosen}, a multiple of multiple_of={multiple_of})" if chosen != asked else ""
            raise ValueError(
                f"reduce_batch_size_fn returned {asked}{rounded} after batch {size} ran out of memory; it must "
                f"return a size below {size} (the same size would fail again, for ever): make it return a smaller one"
            )
    else:  # a jump past a point that barely shrinks with the size (decorator_fixed), else the bound, ×0.9, or
        point = fixed_point(attempts)  # once a call ×0.95 (decorator_steps)
        chosen, how = (fixed_step(attempts, point), FIXED) if point else next_size(attempts, factor)
        if chosen >= multiple_of:
            chosen -= chosen % multiple_of
        chosen = max(1, min(chosen, size - 1))
    attempt.next_batch_size, attempt.next_from = chosen, how
    return chosen


def _lost_message(lost: int, name: str) -> str:
    return (
        f"find_executable_batch_size: an attempt of `{name}` ran out of memory after changing in place {lost} "
        "gradient(s) that existed before the call (its backward pass added into them); they cannot be put back "
        "without a copy and were set to None, so the gradients accumulated before the call are lost. Call the "
        "decorated function at the start of an accumulation window, or after optimizer.zero_grad()"
    )


def _instruments(device: str | torch.device | None) -> DeviceMemory | None:
    target = resolve_device(device)
    if target.type == "cpu":
        simulation = active_simulation()
        return None if simulation is None else SimulatedDeviceMemory(simulation)
    if target.type == "mps":
        return None  # no peak counter
    return AcceleratorMemory(target)
