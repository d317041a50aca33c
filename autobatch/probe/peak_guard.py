"""Stop a trial's step in its backward pass once its allocated peak has passed the trial's limit.

On an accelerator a trial fails when its allocated peak passes the peak limit (the capacity
less the allocator's headroom, :data:`~autobatch.probe.ALLOCATOR_HEADROOM`), even when the
allocator never ran out of memory. Without a guard such a step runs to its end, so it costs as
much as a passing trial, where an OOM stops part-way: the dearest kind of failure, and the
usual one where fragmentation is low, because the line aims just under the limit and the size
above it lands in the band between the limit and the capacity. Measured on an H200 (8 GiB cap,
ResNet-50 ``TrainStep``): 182 ran a whole step 4.8 MiB over the limit, 0.23-0.29 s, where the
OOM at 183 took 0.10-0.16 s; stopped by the guard, 0.06-0.09 s.

A step's peak is reached in its backward pass or before it (saved activations, then the first
gradients and workspaces). A :class:`PeakGuard` hooks the trained model's parameters (a
``TrainStep``'s, or the model a plain callable names in ``restore``): every ``EVERY``-th, in
the order backward reaches them, because each check reads the allocator's statistics. The first
hook that sees the allocated peak above the limit raises :class:`PeakPassed`. A hook allocates
nothing, so the memory a trial measures is unchanged. The trial then fails as "too close to the
capacity", with the peak seen so far as a lower bound of the step's own
(:meth:`~autobatch.probe.trial.TrialRunner.run`), also where a plain callable catches the
guard's exception and raises its own from it.

Not under rank agreement (a rank that stopped part-way would leave the others waiting in a
collective), nor on sharded (DTensor) parameters, whose hooks belong to FSDP's gradient
reduction.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .snapshot.shards import is_dtensor

__all__ = ["PeakGuard", "PeakPassed", "drain_backward", "peak_guard_for", "raised_by_guard"]

# hook every 8th parameter (and the first backward reaches): a check reads the allocator's stats,
# 11 us a read on an H200 host (the nested reader; the public one took 80 us), so ResNet-50's 21
# checks cost a step about 0.2 ms. A probe with and without the guard took the same time within
# the calls' spread (scripts/diag_probe_time.py --step-times [--no-guard]; scripts/diag_stats_readers.py)
EVERY = 8


class PeakPassed(Exception):
    """A trial's step passed the peak limit part-way (not an out-of-memory error)."""

    def __init__(self, peak: int, limit: int) -> None:
        super().__init__(f"allocated peak {peak} B passed the trial's limit of {limit} B part-way through the step")
        self.peak = peak


class PeakGuard:
    """Context manager, entered once per trial: while entered, a hooked parameter's gradient
    accumulation raises :class:`PeakPassed` once ``peak()`` (the allocated peak since the step
    began) is above ``limit``."""

    def __init__(self, params: Iterable[torch.Tensor], peak: Callable[[], int], limit: int) -> None:
        trainable = [p for p in params if p.requires_grad and p.is_leaf]  # hooks take leaves only
        # backward reaches the last parameters first: hook the last one, then every EVERY-th before it
        self.params = [p for i, p in enumerate(reversed(trainable)) if i % EVERY == 0]
        self.peak = peak
        self.limit = limit
        self._handles: list[Any] = []

    def _check(self, _param: torch.Tensor) -> None:
        peak = self.peak()
        if peak > self.limit:
            raise PeakPassed(peak, self.limit)

    def __enter__(self) -> "PeakGuard":
        self._handles = [p.register_post_accumulate_grad_hook(self._check) for p in self.params]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def peak_guard_for(
    model: torch.nn.Module | None, peak: Callable[[], int], limit: int | None, *, agreed: bool
) -> PeakGuard | None:
    """The guard for trials that train ``model`` (a ``TrainStep``'s, or the model a plain
    callable names in ``restore``), or None where none applies: no model, no peak limit (the
    simulated device), trials agreed over ranks, or a model with sharded parameters."""
    if model is None or limit is None or agreed:
        return None
    params = list(model.parameters())
    if not params or any(is_dtensor(p) for p in params):
        return None
    return PeakGuard(params, peak, limit)


def raised_by_guard(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, a :class:`PeakPassed` (a plain callable may
    catch the guard's exception and raise its own)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeakPassed):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def drain_backward() -> None:
    """Let this thread's autograd queue drop the tasks a backward pass that failed part-way left
    in it. When a backward raises (an OOM, :class:`PeakPassed`), the calling thread's ready
    queue keeps the nodes it had not run yet, and with them their saved activations, until the
    next backward on that thread skips them (devices' worker threads skip theirs at once); an
    empty backward is that next one. Under inference mode no backward can have run, and none can
    run: nothing to do (a probe of an inference step may be called inside one)."""
    if torch.is_inference_mode_enabled():
        return
    with torch.enable_grad():
        torch.zeros((), requires_grad=True).sum().backward()
