"""The gradients a plain callable's trial began with, made again after a failed step dropped them.

After a step ran out of memory the probe drops the gradients of every module in ``restore``
(:func:`~autobatch.probe.snapshot.restore_places.after_failed_step`: half-built ones would pin
blocks among the failed step's). But a step that zeroes a model's gradients late holds the last
step's until then: a GAN's step keeps its generator's through the discriminator's forward and
backward, and training holds them there from its second step on. The trial after a failure began
without them, so a one-step search trial passed sizes that train no three steps: a GAN under 8 MiB
(simulated) answered 1208 with ``auto`` and 1210 with ``binary`` (its confirmations stepping down a
percent at a time), where 1219 trains three steps and 1220 does not. So the parameters that had a
dense gradient as the failed trial began get a zero one as the next trial begins (host memory is
not involved: they are the device's, counted by a simulated budget as training counts them).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...memory.lazy_state import LazyStateWatch
from ...memory.oom import is_oom_error
from .restore_places import after_failed_step

__all__ = ["FailedStepGrads", "after_oom"]


class FailedStepGrads:
    """``before_trial`` as each trial of a plain callable begins, ``after_failure`` after its step ran out of memory."""

    def __init__(self, restore: tuple[Any, ...], first: Callable[[], object]) -> None:
        self.restore, self.first = restore, first  # first: the snapshot's undo_forward, as each trial begins
        self._held: list[torch.nn.Parameter] = []  # those with a dense gradient as the running trial began
        self._dropped: list[torch.nn.Parameter] = []  # those of a failed trial, to make again

    def before_trial(self) -> None:
        """Give the parameters the failed trial began with a gradient a zero one, then note which have one now."""
        self.first()
        dropped, self._dropped = self._dropped, []
        try:
            for param in dropped:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        except BaseException as exc:  # noqa: BLE001 - only an OOM: the trial then begins without the rest
            if not is_oom_error(exc):
                raise
        self._held = [param for module in self.restore if isinstance(module, torch.nn.Module)
                      for param in module.parameters() if _dense_grad(param)]

    def after_failure(self) -> None:
        """Drop every module's gradients (:func:`after_failed_step`), keeping which to make again."""
        self._dropped, self._held = self._held, []
        after_failed_step(self.restore)


def _dense_grad(param: torch.Tensor) -> bool:
    """A gradient of the parameter's own shape, dtype and layout (not a sparse embedding's, whose size is the batch's)."""
    grad = param.grad
    return (grad is not None and grad.layout == torch.strided and param.layout == torch.strided
            and grad.shape == param.shape and grad.dtype == param.dtype and type(grad) is type(param.data))


def after_oom(clear_grads: Callable[[], object] | None, grads: FailedStepGrads | None,
              watch: LazyStateWatch) -> Callable[[], None]:
    """What to drop after an OOM trial: the half-built gradients (a ``TrainStep``'s, by its ``clear_grads``, or
    those of the modules given as ``restore`` with a plain callable, ``grads``, which would otherwise pin blocks in
    the middle of the cache until the callable's own ``zero_grad``), a ``GradScaler``'s mark that the failed step
    unscaled its optimizer (:func:`after_failed_step`: the next trial's ``unscale_`` must not raise), and optimizer
    state an interrupted step had only begun to create (:mod:`~autobatch.memory.lazy_state`)."""

    def clear() -> None:
        watch.repair()
        if clear_grads is not None:
            clear_grads()
        elif grads is not None:
            grads.after_failure()

    return clear
