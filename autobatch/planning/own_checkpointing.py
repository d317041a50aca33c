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
"""

from __future__ import annotations

from torch import nn

from .module_names import short_names

__all__ = ["own_checkpointing", "own_checkpointing_hint", "cache_note"]


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


def cache_note(model: nn.Module) -> str | None:
    """A note for a model planned with autobatch's checkpointing that builds a key/value cache
    in training (``model.config.use_cache`` True, Transformers); None otherwise."""
    config = getattr(model, "config", None)
    if not model.training or getattr(config, "use_cache", None) is not True:
        return None
    return ("model.config.use_cache is True: in training the model builds a key/value cache that holds every layer's "
            "keys and values until the step ends, which activation checkpointing cannot free; set "
            "model.config.use_cache = False for training (more fits with checkpointing)")
