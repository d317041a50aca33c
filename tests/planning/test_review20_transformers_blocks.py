"""Activation checkpointing of blocks whose forward writes state it reads again: a key/value cache.

Transformers 5's layers (``GradientCheckpointingLayer``) checkpoint themselves through their class
forward, which drops the cache they would write (``cache=None``) before checkpointing. Wrapped by
autobatch from outside, a ``T5Block`` wrote the cache in forward and again in the recompute, where its
cross-attention found its keys cached, skipped computing them, and backward failed with torch's
``CheckpointError`` ("a different number of tensors was saved"): ``plan()`` on a tiny T5 under a budget
that needs checkpointing crashed with it. A block of the user's own that does the same got torch's
error with no word of autobatch's checkpointing or what to change.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

from autobatch import TrainStep, plan
from autobatch.planning.checkpointing import enable_checkpointing, find_blocks
from autobatch.planning.own_checkpointing import own_checkpointing


class ProtocolLayer(nn.Module):
    """Transformers 5's ``GradientCheckpointingLayer``, as ``transformers.modeling_layers`` has it: the
    class forward is wrapped so that, with ``gradient_checkpointing`` set, the cache a layer would write
    is dropped and the layer runs through ``_gradient_checkpointing_func`` (importing a real T5 takes
    seconds; by hand, a tiny T5 wrapped by autobatch failed in backward just as ``CrossAttention`` does)."""

    gradient_checkpointing = False
    _can_checkpoint_with_cache = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        @functools.wraps(forward)
        def forward_with_checkpointing(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                if not self._can_checkpoint_with_cache and kwargs.get("cache") is not None:
                    kwargs["cache"] = None
                return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs), *args)
            return forward(self, *args, **kwargs)

        cls.forward = forward_with_checkpointing


class CrossAttention(ProtocolLayer):
    """A decoder layer's cross-attention: its keys go into the cache, and are read from it once there."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.key, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x, cache=None):
        key = None if cache is None else cache.get(id(self))
        if key is None:
            key = self.key(x)
            if cache is not None:
                cache[id(self)] = key
        return x + self.out(torch.relu(key * x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CrossAttention() for _ in range(3))

    def forward(self, x):
        cache: dict = {}  # built in every training forward, as a Transformers model with use_cache does
        for layer in self.layers:
            x = layer(x, cache=cache)
        return x.pow(2).mean()


def test_a_layer_that_checkpoints_by_the_transformers_protocol_drops_its_cache_and_keeps_the_gradients():
    torch.manual_seed(0)
    plain = Decoder().double()
    wrapped = copy.deepcopy(plain)
    assert enable_checkpointing(wrapped).modules == ["layers.0", "layers.1", "layers.2"]
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    plain(x).backward()
    wrapped(x).backward()  # CheckpointError: the recompute read the keys the forward had cached
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad), name
    # the layers' own flags are as they were: the planner does not take the model for one that checkpoints itself
    assert own_checkpointing(wrapped) == []
    assert not any(name in layer.__dict__ for layer in wrapped.layers
                   for name in ("gradient_checkpointing", "_gradient_checkpointing_func"))


class CachingBlock(nn.Module):
    """Writes a gate into a cache it is given and reads it back when there (as a decoder's
    cross-attention does its keys): the recompute finds it cached and computes less than the forward."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Parameter(torch.zeros(width)), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, cache):
        gate = cache.get(id(self))
        if gate is None:
            gate = cache[id(self)] = torch.sigmoid(self.gate.sum())
        return x + gate * self.down(torch.relu(self.up(x)))


class CachingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CachingBlock() for _ in range(4))

    def forward(self, x):
        cache: dict = {}
        for block in self.blocks:
            x = block(x, cache=cache)
        return x.pow(2).mean()


def test_a_block_that_recomputes_otherwise_names_autobatchs_checkpointing_and_what_to_change():
    model = CachingModel()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x), lambda n: torch.randn(n, 64, 16))
    with pytest.raises(CheckpointError) as caught:  # batch 1 needs checkpointing here
        plan(step, global_batch=1, memory_limit="80KiB", strategy="binary")
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "plan()'s activation checkpointing of 4 blocks (blocks.0, blocks.1" in note
    assert "allow_checkpointing=False" in note and "checkpoint_targets" in note
    assert find_blocks(model) and not any("forward" in block.__dict__ for block in model.blocks)  # unwrapped again
