"""Models that checkpoint themselves, and a cache that defeats checkpointing (Transformers).

A Transformers model after ``model.gradient_checkpointing_enable()`` checkpoints its own layers
(each has ``gradient_checkpointing = True``, and recomputes itself in training). The planner's
checkpointing would nest a second recompute inside theirs: a third forward per block for no
memory (both keep the block's input), and a plan and error naming blocks "checkpointed" by
autobatch. :func:`own_checkpointing` finds such modules so the planner wraps none of them.

A Transformers causal LM whose ``config.use_cache`` is True builds a key/value cache in every
training forward, holding every layer's keys and values until the step ends: what checkpointing
would free. Planned with autobatch's checkpointing, a tiny Llama (4 layers, 32 tokens, a 500 KiB
simulated budget) fitted micro-batch 1 with the cache and 3 without it
(``model.config.use_cache = False``; ``gradient_checkpointing_enable()`` turns the cache off at
each forward itself). :func:`cache_note` says so where it applies.

Transformers 5's layers (``GradientCheckpointingLayer``: ``GPT2Block``, ``T5Block``, ``LlamaDecoderLayer``
...) wrap their class's ``forward``: with ``gradient_checkpointing`` set, it drops the key/value cache it
would write (``cache=None``, ``use_cache=False``; a layer that only reads it, ``_can_checkpoint_with_cache``,
keeps it) and runs the layer through ``_gradient_checkpointing_func``. Wrapped by autobatch from outside,
the layer wrote the cache in forward and again in the recompute: a ``T5Block``'s cross-attention found its
keys cached by then, skipped computing them, and backward failed with torch's ``CheckpointError`` ("a
different number of tensors was saved"). :func:`checkpoints_by_protocol` tells such layers, which autobatch
checkpoints through that protocol instead. (A layer can drop only a cache passed by keyword: ``GPT2Model``
hands its blocks the cache positionally, drops it under its own flag only, and its recompute writes the
cache again, harmless to the gradients; ``model.config.use_cache = False`` avoids it, as :func:`cache_note` says.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .module_names import short_names

__all__ = ["own_checkpointing", "own_checkpointing_hint", "cache_note", "checkpoint_by_protocol", "checkpoints_by_protocol"]


def own_checkpointing(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` (itself included, as ``the model``) that checkpoint
    themselves: an attribute ``gradient_checkpointing`` that is ``True`` (Transformers' flag, set
    by ``gradient_checkpointing_enable()``), in training mode (their checkpointing runs only then);
    empty where none does."""
    return [name or "the model" for name, module in model.named_modules()
            if module.training and getattr(module, "gradient_checkpointing", None) is True]


def own_checkpointing_hint(names: list[str]) -> str:
    """Why the planner wraps nothing in a model that checkpoints itself, and what to do."""
    return (f"the model checkpoints its own blocks already (gradient_checkpointing=True on {short_names(names)}: "
            "Transformers' model.gradient_checkpointing_enable()), so autobatch wraps none of them again (a second "
            "recompute nested in theirs frees no memory and adds a forward); what was measured ran with that "
            "checkpointing. Call model.gradient_checkpointing_disable() to let autobatch choose the blocks")


def checkpoints_by_protocol(module: nn.Module) -> bool:
    """Whether ``module`` is a Transformers ``GradientCheckpointingLayer`` whose class forward checkpoints
    it, dropping the cache it would write, when ``gradient_checkpointing`` is set (Transformers 5: the class
    has ``_can_checkpoint_with_cache``); autobatch then checkpoints it that way, not from outside."""
    return isinstance(getattr(type(module), "_can_checkpoint_with_cache", None), bool) and \
        isinstance(getattr(module, "gradient_checkpointing", None), bool)


def cache_note(model: nn.Module) -> str | None:
    """A note for a model planned with autobatch's checkpointing that builds a key/value cache
    in training (``model.config.use_cache`` True, Transformers); None otherwise. Also where the blocks
    are checkpointed by their protocol (:func:`checkpoints_by_protocol`): a model that hands its layers
    the cache positionally (``GPT2Model``) drops it only under its own flag, and a layer can strip only
    keywords."""
    config = getattr(model, "config", None)
    if not model.training or getattr(config, "use_cache", None) is not True:
        return None
    return ("model.config.use_cache is True: in training the model builds a key/value cache that holds every layer's "
            "keys and values until the step ends, which activation checkpointing cannot free; set "
            "model.config.use_cache = False for training (more fits with checkpointing)")


def checkpoint_by_protocol(module: nn.Module, run: Any, args: tuple, kwargs: dict) -> Any:
    """A Transformers ``GradientCheckpointingLayer`` checkpointed the way its class forward does it:
    ``gradient_checkpointing`` set and ``run`` as its ``_gradient_checkpointing_func`` for this call,
    so it drops the key/value cache (passed by keyword) it would write again in the recompute (a
    ``T5Block``'s backward failed with ``CheckpointError``) and passes its keywords in a partial. The
    layer's own attributes are put back after the call (the recompute, in backward, runs the inner
    forward and reads neither)."""
    names = ("gradient_checkpointing", "_gradient_checkpointing_func")
    state = module.__dict__
    saved = {name: state[name] for name in names if name in state}
    state["gradient_checkpointing"], state["_gradient_checkpointing_func"] = True, run
    try:
        return type(module).forward(module, *args, **kwargs)
    finally:
        for name in names:
            if name in saved:
                state[name] = saved[name]
            else:
                state.pop(name, None)
