"""Sequence-first inputs the runner would cut along time: one warning at the first step.

The runner splits and counts a batch along dim 0 (:func:`~autobatch.split_batch`). An
``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` or ``nn.MultiheadAttention`` (a ``nn.Transformer*`` layer's
too) built with ``batch_first=False``, the default, reads dim 0 as *time* and dim 1 as the batch.
Fed ``[T, B, E]`` batches, the runner's micro-batches, and an OOM replay's smaller ones, are
slices of time steps: every sample is cut short, silently (the loss and the step run; the model
learns something else). ``global_batch=B`` shows as a batch of T samples (a warning), but
``global_batch=T``, or a model that only sees whole batches until the first OOM, showed nothing.

:class:`SequenceFirst` finds such modules once, when the runner is made (nothing to do for a
model without them). During the first trained step only it watches their input: where its dim 0
is the size of the micro-batch being trained and its dim 1 is not, the module reads the runner's
samples as time steps, and one warning names it and the fix (``batch_first=True`` with
batch-first batches, or ``.transpose(0, 1)`` of the batches and inside the model). A model that
transposes batch-first batches itself feeds the module ``[T, b, E]``, whose dim 1 is the
micro-batch: no warning. Later steps carry no hook. A compiled model (``torch.compile``,
``Module.compile()``) is not watched: a hook added for one step and removed after would make its
graph compile a second time.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..probe.arguments import compiled_model

__all__ = ["SequenceFirst"]

log = logging.getLogger("autobatch")


class SequenceFirst:
    """The ``batch_first=False`` recurrent and attention modules of ``model``, watched at the first step."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [(name, module) for name, module in model.named_modules()
                        if isinstance(module, (nn.RNNBase, nn.MultiheadAttention)) and not module.batch_first]
        self.done = not self.modules or compiled_model(model)  # nothing to watch, or a recompile: no hook, ever

    @contextlib.contextmanager
    def watch(self, sizes: Callable[[], list[int]]) -> Iterator[None]:
        """Around the first step's attempts: hooks on the modules read their input's shape
        against ``sizes()`` (the micro-batch sizes of the attempt running); removed after it."""
        if self.done:
            yield
            return
        seen: list[str] = []

        def hook(name: str) -> Callable[..., None]:
            def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                value = args[0] if args else kwargs.get("input", kwargs.get("query"))
                if not seen and isinstance(value, torch.Tensor) and value.dim() >= 3:
                    pieces = set(sizes())
                    if value.shape[0] in pieces and value.shape[1] not in pieces:
                        seen.append(f"{name or 'model'} ({type(module).__name__}, input {tuple(value.shape)})")
            return check

        handles = [module.register_forward_pre_hook(hook(name), with_kwargs=True) for name, module in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.done = True
            if seen:
                log.warning(
                    "%s has batch_first=False: it reads dim 0 as time, but dim 0 of its input is the runner's "
                    "micro-batch (%s samples): the runner splits and counts samples along dim 0, so a micro-batch, and "
                    "an OOM replay's smaller one, is a slice of time steps, not of samples. Make the batches batch-first "
                    "([B, T, ...]) and build the module with batch_first=True (or .transpose(0, 1) inside the model)",
                    seen[0], " or ".join(map(str, sorted(set(sizes()), reverse=True))))
