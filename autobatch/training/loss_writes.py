"""State outside the model that ``loss_fn`` changes: an EMA updated per micro-batch, and again on a replay.

``loss_fn`` runs once per micro-batch, and again for every micro-batch an OOM replay runs again.
A ``loss_fn`` ported from a hand-written loop sometimes keeps that loop's other per-step work: an
EMA or SWA model moved towards the weights (``ema.update_parameters(model)``), a teacher's running
statistics, a metric's counts, a MoCo-style queue held beside the model. Such state moves once per
micro-batch (twice a step at ``micro_batch = global_batch / 2``: an EMA of decay ``d`` decays by
``d**2``), and a failed attempt's moves stay when the step is replayed, for the runner puts back
only the model's own buffers and parameters (:class:`~autobatch.training.oom.buffer_guard.BufferGuard`):
an ``AveragedModel`` EMA updated in ``loss_fn`` (an MLP, SGD, 4 steps of 8) ended 0.057 from the same run without
an OOM after one replay in backward, and 0.048 from it at micro-batch 4 without one
(``tests/training/test_review35_loss_writes.py``).

So in the span ``loss_fn`` runs in (between a micro-batch's ``"forward"`` and ``"backward"``
phases, which :mod:`~autobatch.training.grad_watch` watches too) the runner reads the version
counters of the tensors ``loss_fn`` reaches outside the model: the parameters and buffers of the
modules, and the tensors, its closure, its bound object, a ``functools.partial``'s arguments and
the globals its code names hold, and theirs, three levels deep (found once, at the first step).
One in-place write there (``copy_``, ``lerp_``, ``+=``; ``detach()`` shares the counter) warns
once, naming the tensor and ``on_step_end``, where such an update runs once per applied step and
is never replayed. No device sync: a version is a host counter, but reading one costs 0.3 to 1.3 µs,
so at most :data:`MAX_WATCHED` tensors are read, in the first :data:`WATCHED_STEPS` steps of a
runner only (a ``loss_fn`` does the same work every step; one that starts its EMA later is not
seen), and none once it warned. A tensor rebound rather than written (``ema = 0.9 * ema + ...`` in
a global) is not seen either.

A written parameter with a gradient was stepped by an optimizer of its own inside ``loss_fn`` (a GAN's
discriminator): the warning says so, and that the runner takes no such step, where it named ``on_step_end``
(review 36).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any, Iterator

import torch

from ..errors import in_packages
from ..probe.tracing.trace_state import code_references

__all__ = ["WatchesLossWrites", "outside_tensors"]

log = logging.getLogger("autobatch")

MAX_WATCHED = 256  # tensors read per micro-batch, at most
WATCHED_STEPS = 3  # steps of a runner watched, from the first it trains
_LEVELS = 3  # loss_fn -> a helper or object it names -> what that holds
_ITEMS = 16  # items of a list, tuple or dict looked at


def outside_tensors(loss_fn: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the tensors ``loss_fn`` reaches that are neither ``model``'s nor ``optimizer``'s
    (module docstring), at most :data:`MAX_WATCHED`."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    own |= {id(p) for group in optimizer.param_groups for p in group["params"]}
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, str, int]] = [(loss_fn, "loss_fn", 0)]
    while todo and len(found) < MAX_WATCHED:
        value, name, level = todo.pop(0)
        if id(value) in seen or level > _LEVELS:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if id(value) not in own:
                found.setdefault(id(value), (name, value))
        elif isinstance(value, torch.nn.Module):
            if value is not model:
                tensors = [*value.named_parameters(), *value.named_buffers()]
                found.update((id(t), (f"{name}.{n}", t)) for n, t in tensors if id(t) not in own and id(t) not in found)
        else:
            todo += [(child, f"{name}.{child_name}" if child_name else name, level + 1)
                     for child_name, child in _children(value)]
    return list(found.values())[:MAX_WATCHED]


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    """What ``value`` holds or names: never a class, a Python module, or a library's function."""
    if isinstance(value, (functools.partial, types.MethodType, types.FunctionType)):
        yield from code_references(value, _library)
    elif isinstance(value, (list, tuple)):
        yield from ((f"[{i}]", item) for i, item in enumerate(value[:_ITEMS]))
    elif isinstance(value, dict):
        yield from ((f"[{key!r}]", item) for key, item in list(value.items())[:_ITEMS])
    elif not isinstance(value, (type, types.ModuleType, str, bytes)) and hasattr(value, "__dict__"):
        if callable(value):
            yield "", getattr(type(value), "__call__", None)
        yield from vars(value).items()


def _library(function: types.FunctionType) -> bool:
    return in_packages(getattr(function, "__module__", None) or "", ("torch", "autobatch"))


class WatchesLossWrites:
    """A mixin of the runner's recovery (its phase hook calls :meth:`_watch_loss_writes` through
    :class:`~autobatch.training.grad_watch.WatchesGrads`; ``loss_fn``, ``model``, ``optimizer`` are the runner's)."""

    _outside: list[tuple[str, torch.Tensor]] | None = None  # found at the first forward; [] once warned
    _outside_until = 0  # the step from which nothing is watched
    _outside_versions: list[int] | None = None  # their versions at this micro-batch's forward

    def _watch_loss_writes(self, phase: str) -> None:
        """At ``"forward"`` note the versions; at ``"backward"`` warn once where ``loss_fn`` wrote one."""
        if self._outside is None:
            self._outside = outside_tensors(self.loss_fn, self.model, self.optimizer)
            self._outside_until = self.step + WATCHED_STEPS
        if not self._outside:
            return
        if self.step >= self._outside_until:
            self._outside = []  # watched long enough: nothing is read per micro-batch from here on
            return
        if phase == "forward":
            self._outside_versions = [tensor._version for _, tensor in self._outside]
            return
        versions, self._outside_versions = self._outside_versions, None
        if phase != "backward" or versions is None:
            return
        written = [(name, tensor) for (name, tensor), version in zip(self._outside, versions) if tensor._version != version]
        if not written:
            return
        self._outside = []  # warned: watch nothing more
        name, tensor = written[0]
        more = f" (and {len(written) - 1} more)" if len(written) > 1 else ""
        stepped = next((n for n, t in written if isinstance(t, torch.nn.Parameter) and t.grad is not None), None)
        if stepped is not None:  # trained by an optimizer of its own inside loss_fn: a GAN's discriminator
            log.warning(
                "loss_fn changed %s %s%s in place, a parameter with a gradient outside the model: an optimizer of its "
                "own stepped it inside loss_fn (a GAN's discriminator). loss_fn runs once per micro-batch and again "
                "for each one an OOM replay runs again, so that optimizer steps once per micro-batch and keeps a "
                "failed attempt's steps: the runner steps one optimizer, and a step of several losses each stepping "
                "its own optimizer is no step it takes. Probe it as a plain callable, find_max_batch(fn, "
                "restore=(gen, opt_g, disc, opt_d)), and train it in your own loop at that batch size",
                stepped, tuple(dict(written)[stepped].shape), more)
            return
        log.warning(
            "loss_fn changed %s %s%s in place, a tensor outside the model (an EMA or SWA model's weights, a teacher's "
            "running statistics, a metric, a queue): loss_fn runs once per micro-batch and again for each one an OOM "
            "replay runs again, and a replay puts back the model's own state only, so this state moves once per "
            "micro-batch (an EMA decays faster when the step is split) and keeps a failed attempt's moves. Update an "
            "EMA or SWA model in fit(..., on_step_end=...) (once per applied step, never replayed; give it as "
            "extra_state so checkpoints hold it); keep state the step itself must change in the model, as a registered "
            "buffer (a replay puts those back)", name, tuple(tensor.shape), more)
