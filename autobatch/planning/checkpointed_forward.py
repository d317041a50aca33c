"""The forward installed on a block that activation checkpointing wraps, and who owns it.

Split from :mod:`.checkpointing` (which finds the blocks and hands out the handles that wrap and
unwrap them): this is the object a wrapped block calls, its recompute's rules, and its ownership.
A forward belongs to the :class:`~.checkpointing.CheckpointHandle` that installed it; one a
``copy.deepcopy`` or ``torch.save``/``torch.load`` of a wrapped model carries over belongs to no
handle, so ``enable_checkpointing`` (and ``Plan.apply``) on that copy adopts it, and the handle's
``undo()`` (``plan.undo()``) unwraps the copy.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .own_checkpointing import checkpoint_by_protocol, checkpoints_by_protocol, recompute_without_cache
from .recompute_state import recompute_contexts, writes_state

__all__ = ["is_checkpointed", "is_orphaned"]


class _CheckpointedForward:
    """The forward installed on a wrapped block: the class's forward through a non-reentrant
    checkpoint whose recompute leaves running statistics alone (:class:`_RunningStatsKept`).

    An object of a module-level class that holds its block (a bound method of a function
    pickled as ``getattr(block, "_checkpointed_forward")``, which fails), so a wrapped model
    can be pickled; a deepcopy or an unpickled copy holds, and calls, its own block.

    It holds the block weakly: the block holds it (``block.forward``), and a strong reference
    back was a cycle, so a wrapped model dropped without ``undo()`` kept every wrapped block's
    weights (most of the model) until the garbage collector's next full collection (review 38).
    The block is alive whenever this is called: it is the block's own forward."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self.owned = True  # by the handle that installs it

    @property
    def module(self) -> nn.Module:
        """The wrapped block."""
        return self._module()

    def __getstate__(self) -> dict[str, Any]:
        # a deepcopy's or an unpickled copy's forward belongs to no handle: enable_checkpointing on the
        # copy adopts it (Plan.apply on a copy of the wrapped model returned an empty handle, and
        # plan.undo() left the copy checkpointed, with no handle that could unwrap it)
        return {"module": self.module, "owned": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._module, self.owned = weakref.ref(state["module"]), state.get("owned", False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = type(module).forward.__get__(module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # the block's keywords go in a partial, never to checkpoint itself: checkpoint takes
        # debug, early_stop, determinism_check, context_fn and use_reentrant as its own options
        # (a block's debug=True was eaten silently; its use_reentrant was a TypeError)
        compiling = torch.compiler.is_compiling()
        if compiling or not writes_state(module):
            # compiled, the partitioner recomputes and buffer updates are applied once, from the
            # graph's outputs; a custom context_fn would take torch's selective-checkpoint path
            run = functools.partial(checkpoint, use_reentrant=False)
        else:
            run = functools.partial(checkpoint, use_reentrant=False, context_fn=functools.partial(recompute_contexts, module))
        if module.training and not compiling and checkpoints_by_protocol(module):
            return checkpoint_by_protocol(module, run, args, kwargs)
        if compiling:  # traced once: no Python recompute writes a cache again
            return run(functools.partial(forward, **kwargs) if kwargs else forward, *args)
        return run(recompute_without_cache(module, forward, kwargs), *args)

    def __repr__(self) -> str:
        return f"<checkpointed forward of {type(self.module).__name__}>"


def is_orphaned(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by a forward that a copy of a wrapped model carried over (no handle owns it)."""
    return is_checkpointed(module) and not getattr(module.__dict__["forward"], "owned", False)  # none: pickled before it


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is autobatch's checkpointed forward."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)
