"""An optimizer the probe's trials stepped that ``restore`` does not put back, told.

A plain callable given ``restore=(model, optimizer)`` may step another optimizer too: a GAN's
step trains its discriminator with its own optimizer. Before, the probe put back what ``restore``
named and nothing said that the other one kept the trials' steps (Adam's moments and step count,
and the discriminator's weights where no module in ``restore`` holds them): a run after the probe
started from a discriminator trained a dozen steps on random batches. The probe sees every
optimizer step (:class:`~autobatch.memory.lazy_state.LazyStateWatch`), so it can name the one.

Likewise an LR scheduler the callable steps that ``restore`` does not name: the restore put the
optimizer's learning rates back, and the scheduler stayed the trials' steps ahead, so the next
``scheduler.step()`` jumped down the schedule. A scheduler of a restored optimizer that the callable
reaches (its closure, the globals its code reads) is put back too (:func:`with_found_schedulers`).
So is an enabled fp16 ``GradScaler`` it reaches: ``restore=(model, optimizer)`` left it with the
trials' scale and growth tracker (each good trial grew it, each overflow backed it off, so the run
after the probe started from another scale than before it), and a trial that ran out of memory
after ``scaler.unscale_(optimizer)`` ended the probe with "unscale_() has already been called".
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Iterable, Iterator

import torch

from ...memory.lazy_state import hooked
from .restore_places import SCHEDULERS
from ..tracing.trace_state import _reachable, code_globals

__all__ = ["warn_unrestored_optimizers", "trained_for_real_note", "caller_restores", "with_found_schedulers"]

#: set while a caller that puts the model and optimizers back itself probes a plain callable
_CALLER_RESTORES: contextvars.ContextVar[bool] = contextvars.ContextVar("autobatch_caller_restores", default=False)


@contextlib.contextmanager
def caller_restores() -> Iterator[None]:
    """Probe a plain callable whose caller puts everything back itself (Lightning's callback: its
    saved state), so no note says the trials trained the model for real: there it was untrue."""
    token = _CALLER_RESTORES.set(True)
    try:
        yield
    finally:
        _CALLER_RESTORES.reset(token)


def _trained(optimizer: Any) -> set[int]:
    """The ids of the parameters an optimizer (or a wrapper of one) trains."""
    return {id(param) for group in getattr(hooked(optimizer), "param_groups", ()) for param in group["params"]}


def _real(optimizer: Any) -> bool:
    """Not an estimate's fake copy (its parameters ``FakeTensor``s): a trace that gave up keeps its
    step alive in the saved error's traceback, and the copy's fake AdamW was named as a stepped
    optimizer not in ``restore`` (a Transformers ``fit_batch_size`` got that warning, whose
    ``restore=`` it cannot even be given)."""
    from torch._subclasses.fake_tensor import FakeTensor

    groups = getattr(hooked(optimizer), "param_groups", ())
    return not any(isinstance(param, FakeTensor) for group in groups for param in group["params"])


def warn_unrestored_optimizers(stepped: Iterable[torch.optim.Optimizer], restore: tuple[Any, ...] | None) -> None:
    """Warn (``RuntimeWarning``) where an optimizer in ``stepped`` trains a parameter that no
    optimizer in ``restore`` trains: the probe put back neither its state nor, outside the modules
    in ``restore``, those weights. One that trains only parameters a restored optimizer trains (a
    ``ZeroRedundancyOptimizer``'s inner one, a wrapper's) is covered by that one's state dict."""
    if restore is None:  # a plain callable without restore trains for real, as documented
        return
    covered = set().union(*(_trained(item) for item in restore  # a scheduler's .optimizer is not restored by it
                            if isinstance(hooked(item), torch.optim.Optimizer) and not isinstance(item, SCHEDULERS)))
    for optimizer in filter(_real, stepped):
        if _trained(optimizer) - covered:
            warnings.warn(
                f"the probe's trials stepped an optimizer that restore does not hold ({type(optimizer).__name__}), "
                "so it keeps their steps (its state, and the weights it trains where no module in restore holds "
                "them); pass it, and the module it trains, in restore=(model, optimizer, other_model, other_optimizer)",
                RuntimeWarning, stacklevel=4,
            )
            return


def trained_for_real_note(stepped: Iterable[torch.optim.Optimizer], restore: tuple[Any, ...] | None) -> str | None:
    """A note for a plain callable probed without ``restore`` whose trials stepped optimizers: they
    trained the model for real, as documented, and nothing said so (a user who expected the probe
    to leave the model as it found it, as it does a ``TrainStep``'s, started training from weights
    the trials had moved). None otherwise."""
    names = sorted({type(optimizer).__name__ for optimizer in filter(_real, stepped)})
    if restore is not None or not names or _CALLER_RESTORES.get():
        return None
    return (f"the trials trained the model for real: a plain callable probed without restore keeps their steps "
            f"({', '.join(names)} stepped); pass restore=(model, optimizer) to have weights and optimizer state put back")


def with_found_schedulers(fn: Any, restore: tuple[Any, ...] | None, notes: list[str]) -> tuple[Any, ...] | None:
    """``restore`` with the LR schedulers of its optimizers that the plain callable ``fn`` reaches
    (its closure, the objects it holds, the globals its code reads) and ``restore`` lacks, so the
    probe puts their step counts back beside the learning rates, and with the enabled
    ``GradScaler``s it reaches (their scale, growth tracker and ``unscale_`` marks); a note in ``notes`` says what was
    put back and what the probe cannot know (what the callable keeps itself). A ``TrainStep``
    steps no scheduler: ``restore`` as it is."""
    if restore is None or all(hasattr(fn, name) for name in ("model", "loss_fn", "make_batch", "optimizer")):
        return restore
    optimizers = {id(hooked(item)) for item in restore
                  if isinstance(hooked(item), torch.optim.Optimizer) and not isinstance(item, SCHEDULERS)}
    given = {id(item) for item in restore}
    kinds = (*SCHEDULERS, torch.amp.GradScaler)
    read: list[tuple[Any, str, Any]] = []  # every global the code reads: torch's objects, which code_globals skips
    roots = [fn, *code_globals([fn], bindings=read).values(), *(value for _, _, value in read if isinstance(value, kinds))]
    reached = [value for value in _reachable(roots, leaf=lambda v: isinstance(v, kinds))
               if isinstance(value, kinds) and id(value) not in given]
    found = [value for value in reached
             if isinstance(value, SCHEDULERS) and id(hooked(getattr(value, "optimizer", None))) in optimizers]
    scalers = [value for value in reached if isinstance(value, torch.amp.GradScaler) and value.is_enabled()]
    names = ", ".join(type(item).__name__ for item in restore)
    added = (f", and the {', '.join(type(item).__name__ for item in found)} the callable steps (not in restore: its "
             "step count with the learning rates)") if found else ""
    added += ", and the GradScaler it steps (not in restore: its scale and growth tracker)" if scalers else ""
    found += scalers
    notes.append(f"the probe put back what restore holds ({names}){added}; not what the callable keeps itself "
                 "(a step counter, a data iterator's position, a list of losses, a logger's steps)")
    return (*restore, *found)
