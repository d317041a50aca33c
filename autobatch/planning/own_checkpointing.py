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
checkpoints through that protocol instead. (The protocol drops a cache passed by keyword only: ``GPT2Model``
hands its blocks the cache positionally, and drops it under its own flag only; its blocks wrote their keys again
in the recompute, and a batch with a padding ``attention_mask`` failed in backward. A cache parameter passed
positionally is dropped too: :func:`_positional_cache_dropped`.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from ..probe.tracing.estimate import EstimateError, estimate_memory
from ..probe.tracing.trace_failures import from_the_step
from ..probe.train_step import TrainStep
from .module_names import short_names

__all__ = ["CacheWatch", "own_checkpointing", "own_checkpointing_hint", "cache_note", "checkpoint_by_protocol",
           "checkpoints_by_protocol", "recompute_without_cache", "recomputed_blocks"]


def own_checkpointing(model: nn.Module, recomputed: list[str] | None = None) -> list[str]:
    """Names of the modules of ``model`` (itself included, as ``the model``) that checkpoint
    themselves: an attribute ``gradient_checkpointing`` that is ``True`` (Transformers' flag, set
    by ``gradient_checkpointing_enable()``), in training mode (their checkpointing runs only then);
    else ``recomputed``, the blocks the model's own code recomputes in backward
    (:func:`recomputed_blocks`); empty where none does."""
    return [name or "the model" for name, module in model.named_modules()
            if module.training and getattr(module, "gradient_checkpointing", None) is True] or list(recomputed or [])


def own_checkpointing_hint(names: list[str], model: nn.Module | None = None) -> str:
    """Why the planner wraps nothing in a model that checkpoints itself, and what to do; ``model``
    given, blocks without Transformers' flag are those its own code recomputes (:func:`recomputed_blocks`)."""
    flagged = model is None or any(getattr(model.get_submodule("" if name == "the model" else name),
                                           "gradient_checkpointing", None) is True for name in names)
    if not flagged:
        return (f"the model checkpoints its own blocks already (its code recomputes {short_names(names)} in backward: "
                "torch.utils.checkpoint.checkpoint in its forward), so autobatch wraps none of them again (a second "
                "recompute nested in the model's frees no memory and adds a forward); what was measured ran with that "
                "checkpointing. Remove it from the forward to let autobatch choose the blocks")
    # Transformers 5.24 has activation_checkpointing_*; its gradient_checkpointing_disable warns FutureWarning (gone in v6)
    renamed = model is not None and callable(getattr(model, "activation_checkpointing_disable", None))
    kind = "activation" if renamed else "gradient"
    return (f"the model checkpoints its own blocks already (gradient_checkpointing=True on {short_names(names)}: "
            f"Transformers' model.{kind}_checkpointing_enable()), so autobatch wraps none of them again (a second "
            "recompute nested in theirs frees no memory and adds a forward); what was measured ran with that "
            f"checkpointing. Call model.{kind}_checkpointing_disable() to let autobatch choose the blocks")


def recomputed_blocks(step: Any, names: list[str], batch_size: int = 1) -> list[str]:
    """Which of the blocks ``names`` (those autobatch would wrap) the model's own code already recomputes in
    backward: ``torch.utils.checkpoint.checkpoint(block, x)`` in the user's forward, reentrant or not. Such a
    block's forward runs again while autograd runs backward, which a forward pre-hook sees during one step
    traced with fake tensors at ``batch_size`` (nothing allocated, the model and generators put back; the trials
    cannot tell: one that ran out of memory before backward, or a cache hit, ran no backward). The planner
    wrapped such blocks again, nesting its recompute in the model's: the same peak (a model checkpointing its
    4 blocks itself failed at batch 1 at 38.01 KiB both ways), and an error saying "with activation
    checkpointing of 4 blocks" as if checkpointing had been tried and not helped. Empty where the step cannot
    be traced (an :class:`~autobatch.probe.tracing.estimate.EstimateError`, or the step's own error under fake tensors:
    the trials then run it for real)."""
    model = getattr(step, "model", None)
    if not names or not isinstance(step, TrainStep) or model is None:
        return []
    seen = _Recomputes()  # autobatch's own object: the trace puts back what it reaches of the user's, not this
    handles = [model.get_submodule(name).register_forward_pre_hook(functools.partial(seen, name)) for name in names]
    try:
        estimate_memory(step, batch_size, steps=1)
    except Exception as exc:  # noqa: BLE001 - untraceable (data-dependent shapes, .item()): the trials run it for real
        if not isinstance(exc, EstimateError) and not from_the_step(exc):
            raise
        return []
    finally:
        for handle in handles:
            handle.remove()
    return [name for name in names if name in seen.names]


class _Recomputes:
    """A forward pre-hook noting the blocks whose forward runs while autograd runs backward (a recompute)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __call__(self, name: str, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            self.names.add(name)


def checkpoints_by_protocol(module: nn.Module) -> bool:
    """Whether ``module`` is a Transformers ``GradientCheckpointingLayer``, which checkpoints itself,
    dropping the cache it would write, when ``gradient_checkpointing`` is set (Transformers 5: the class
    has ``_can_checkpoint_with_cache``; 4.5x: the base class by name, its protocol in ``__call__``);
    autobatch then checkpoints it that way, not from outside."""
    if not isinstance(getattr(module, "gradient_checkpointing", None), bool):
        return False
    return isinstance(getattr(type(module), "_can_checkpoint_with_cache", None), bool) or \
        _checkpointing_layer(type(module)) is not None


class CacheWatch:
    """What the model's forwards handed back while checkpointed: whether their outputs hold a key/value
    cache with anything in it (a forward hook on the model, :meth:`watching`). ``config.use_cache`` alone
    says too much: an encoder (``BertConfig`` has ``use_cache=True``) builds no cache, and Transformers 5's
    layers checkpointed by their protocol drop the cache they would write (a tiny Llama, T5 or Whisper
    under autobatch's checkpointing returned an empty one and peaked the same with ``use_cache=False``),
    yet the plan's note and error told them to turn it off, "more fits". ``GPT2Model``, which hands its blocks
    the cache positionally, filled it (and peaked 37 % higher) until such a cache was dropped too."""

    def __init__(self) -> None:
        self.held: list[bool] = []  # one per forward whose output told

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator[None]:
        hook = model.register_forward_hook(self._seen)
        try:
            yield
        finally:
            hook.remove()

    def _seen(self, module: nn.Module, args: Any, output: Any) -> None:
        held = _cache_held(output)
        if held is not None:
            self.held.append(held)

    def empty(self) -> bool:
        """Whether forwards were seen and none handed back a cache holding anything."""
        return bool(self.held) and not any(self.held)


def _cache_held(output: Any) -> bool | None:
    """Whether a forward's ``output`` holds a key/value cache with something in it; None where it cannot
    tell (not a Transformers output: a tensor, a model of the user's own keeping its cache inside)."""
    if not isinstance(output, Mapping) or not type(output).__module__.startswith("transformers."):
        return None
    # a ModelOutput leaves out None fields. Its fields read as a plain dict: in Transformers 5 any lookup of the old
    # name "past_key_values" (its get, [] or in) logs "`past_key_values`/`cache_params` are deprecated" to the user
    fields = dict(output.items())
    return _holds(fields["cache"] if "cache" in fields else fields.get("past_key_values"))


def _holds(cache: Any) -> bool:
    if cache is None:
        return False
    if isinstance(cache, torch.Tensor):
        return cache.numel() > 0
    if isinstance(cache, (tuple, list)):  # the legacy form: per layer, a tuple of key and value tensors
        return any(_holds(part) for part in cache)
    parts = (cache, getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None))
    lengths = [part.get_seq_length() for part in parts if callable(getattr(part, "get_seq_length", None))]
    return any(length > 0 for length in lengths) if lengths else True  # a kind it does not know: as if held


def cache_note(model: nn.Module, watch: CacheWatch | None = None) -> str | None:
    """A note for a model planned with autobatch's checkpointing that builds a key/value cache
    in training (``model.config.use_cache`` True, Transformers); None otherwise, and None where ``watch``
    saw the model's checkpointed forwards hand back no cache or an empty one (:class:`CacheWatch`), as
    Transformers 5's layers checkpointed by their protocol do (:func:`checkpoints_by_protocol`; a cache handed
    over positionally, ``GPT2Model``'s, is dropped too). A cache the model keeps otherwise is noted."""
    config = getattr(model, "config", None)
    if not model.training or getattr(config, "use_cache", None) is not True or (watch is not None and watch.empty()):
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
    forward and reads neither). A cache handed over positionally is dropped too
    (:func:`_positional_cache_dropped`). Where the protocol lives in the class's ``__call__``
    (:func:`_protocol_in_call`), which this forward is called from, it is done here as that
    ``__call__`` does it: the cache keywords dropped, the class forward run through ``run``."""
    names = ("gradient_checkpointing", "_gradient_checkpointing_func")
    args = _positional_cache_dropped(module, args)
    if _protocol_in_call(type(module)):  # Transformers before 5.2x: the class forward alone checkpoints nothing
        # use_cache kept: the models of 4.5x read the layer's outputs by it (4.53's T5Stack indexed one a layer told
        # use_cache=False did not return: IndexError), their flag being off; the cache itself is not written
        kwargs = _cache_keywords_dropped(module, kwargs, use_cache=True)
        return run(functools.partial(type(module).forward.__get__(module), **kwargs), *args)
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


def recompute_without_cache(module: nn.Module, forward: Any, kwargs: dict) -> Any:
    """``forward`` with ``kwargs`` for a checkpoint of a Transformers layer wrapped from outside (no
    ``GradientCheckpointingLayer``: Transformers 4.40-4.51 have none), which drops the key/value cache in the
    recompute only (:func:`_cache_keywords_dropped`, :func:`_positional_cache_dropped`), as those versions' models
    do under their own flag. The forward keeps it: it writes the cache once and hands it back, which the model's
    code reads (4.46's ``LlamaModel`` indexes the layer's output for it, and failed on a cache of None). Passed
    through, the recompute wrote the keys again and attended over twice the tokens: a tiny ``LlamaForCausalLM`` or
    ``T5ForConditionalGeneration`` (4.46.3) with a padding ``attention_mask`` failed in backward ("The size of
    tensor a (32) must match the size of tensor b (16)"), and so did ``plan()``. Other layers: ``forward`` as is."""
    if not type(module).__module__.startswith("transformers."):
        return functools.partial(forward, **kwargs) if kwargs else forward

    def run(*args: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # the forward; a recompute runs while autograd runs backward
            return forward(*args, **kwargs)
        return forward(*_positional_cache_dropped(module, args), **_cache_keywords_dropped(module, kwargs))

    return run


_CACHE_PARAMETERS = ("cache", "layer_past", "past_key_values", "past_key_value")


@functools.lru_cache(maxsize=None)
def _protocol_in_call(cls: type) -> bool:
    """Whether ``cls``'s ``GradientCheckpointingLayer`` keeps its protocol in ``__call__`` (Transformers up to
    5.17 at least; later ones wrap each subclass's ``forward``). There, running the class ``forward`` with
    ``gradient_checkpointing`` set, as :func:`checkpoint_by_protocol` does for a wrapped ``forward``, checkpointed
    nothing: on an H200 (Transformers 5.17) a 12-layer Llama's and GPT-2's layers ran once per step, none
    recomputed, and a step at batch 1 held the same 1.3 GiB after its forward as without autobatch's
    checkpointing, where ``plan()`` reported 12 blocks checkpointed."""
    layer = _checkpointing_layer(cls)
    return layer is not None and "__call__" in vars(layer)


def _checkpointing_layer(cls: type) -> type | None:
    """Transformers' ``GradientCheckpointingLayer`` among ``cls``'s bases, by name (not imported: autobatch
    does not need Transformers), or None."""
    return next((klass for klass in cls.__mro__ if klass.__name__ == "GradientCheckpointingLayer"), None)


def _cache_keywords_dropped(module: nn.Module, kwargs: dict, use_cache: bool = False) -> dict:
    """``kwargs`` as a ``__call__`` protocol hands them to its checkpoint: ``use_cache`` off (unless ``use_cache``:
    kept as given) and, unless the layer only reads its cache (``_can_checkpoint_with_cache``), a key/value cache
    passed by keyword None."""
    kwargs = dict(kwargs)
    if kwargs.get("use_cache") and not use_cache:
        kwargs["use_cache"] = False
    if not getattr(type(module), "_can_checkpoint_with_cache", False):
        kwargs.update({name: None for name in _CACHE_PARAMETERS if kwargs.get(name) is not None})
    return kwargs


@functools.lru_cache(maxsize=None)
def _cache_positions(cls: type) -> tuple[int, ...]:
    """Which positional arguments of ``cls.forward`` (``self`` left out) are a key/value cache, by name."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read: nothing known to drop
        return ()
    return tuple(index for index, parameter in enumerate(parameters) if parameter.name in _CACHE_PARAMETERS
                 and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD))


def _positional_cache_dropped(module: nn.Module, args: tuple) -> tuple:
    """``args`` with a key/value cache passed positionally replaced by None, as the layer's protocol drops one passed
    by keyword (unless the layer only reads it, ``_can_checkpoint_with_cache``). ``GPT2Model`` hands its blocks the
    cache positionally and drops it under its own flag only: checkpointed by autobatch, each block wrote its keys
    again in the recompute, which then attended over twice the tokens, and a batch with an ``attention_mask``
    failed in backward ("The size of tensor a (32) must match the size of tensor b (16)"); so did ``plan()``."""
    if getattr(type(module), "_can_checkpoint_with_cache", False):
        return args
    positions = [index for index in _cache_positions(type(module)) if index < len(args) and args[index] is not None]
    if not positions:
        return args
    return tuple(None if index in positions else arg for index, arg in enumerate(args))
