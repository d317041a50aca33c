"""plan() on Transformers-style models: one that checkpoints its own blocks
(``gradient_checkpointing_enable()``), and one that builds a key/value cache in training.

The first had autobatch's checkpointing nested inside its own (a second recompute per block, no
memory freed), and its ``NoBatchFitsError`` said "this is with activation checkpointing of 4
blocks" as if autobatch's had been tried on a plain model. The second (``config.use_cache``
True) keeps every layer's keys and values through the step, which checkpointing cannot free: a
tiny Llama under 500 KiB planned 1 x 32 with the cache, 3 x 11 without it, and nothing said so.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.checkpointing import is_checkpointed


class Layer(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, cache=None):
        hidden = self.up(x)
        if cache is not None:  # a key/value cache: what the layer computed stays referenced
            cache.append(hidden)
        return x + self.down(torch.relu(hidden))


class LM(nn.Module):
    """Transformers' shape: layers in a ModuleList, ``gradient_checkpointing`` flags set by
    ``gradient_checkpointing_enable()``, ``config.use_cache``."""

    def __init__(self, use_cache: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=use_cache)
        self.layers = nn.ModuleList(Layer() for _ in range(6))
        self.gradient_checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.gradient_checkpointing = True

    def forward(self, x):
        cache = [] if self.config.use_cache else None
        for layer in self.layers:
            own = self.gradient_checkpointing and self.training
            x = checkpoint(layer, x, use_reentrant=False) if own else layer(x, cache)
        return x.pow(2).mean()


def lm_step(model: nn.Module) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x), lambda n: torch.randn(n, 64, 16))


def test_a_model_that_checkpoints_itself_is_not_wrapped_again_and_the_error_says_so():
    torch.manual_seed(0)
    model = LM()
    model.gradient_checkpointing_enable()
    with pytest.raises(NoBatchFitsError) as caught:
        plan(lm_step(model), global_batch=2, memory_limit="100KiB", steps_per_trial=1, strategy="binary")
    message = str(caught.value)
    assert "checkpoints its own blocks already" in message and "with activation checkpointing of" not in message
    assert not any(probe["checkpointing"] for probe in caught.value.attempts)  # no nested probe
    assert not any(is_checkpointed(module) for module in model.modules())


def test_checkpointing_a_model_with_a_training_cache_names_the_cache():
    torch.manual_seed(0)
    options = dict(global_batch=2, memory_limit="200KiB", steps_per_trial=1, strategy="binary")
    with pytest.raises(NoBatchFitsError, match=r"Try model.config.use_cache = False \(its key/value cache"):
        plan(lm_step(LM(use_cache=True)), **options)
    without = plan(lm_step(LM(use_cache=False)), **options)  # what the advice buys: it fits with checkpointing
    assert without.checkpointing and without.micro_batch_sizes == [2]
    assert not any("use_cache" in note for note in without.notes)
    without.undo()


def test_the_runners_checkpointing_fallback_does_not_nest_in_a_model_that_checkpoints_itself():
    """At micro-batch 1 the runner's fallback wrapped the layers of a model that checkpoints its
    own: the step now stops with the reason, and no block is wrapped."""
    from autobatch import FaultInjector, Runner, StepOutOfMemoryError

    model = LM()
    model.gradient_checkpointing_enable()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x), global_batch=2, micro_batch=1,
                    checkpointing_fallback=True, progress=False, faults=FaultInjector([(0, "forward")]))
    with pytest.raises(StepOutOfMemoryError, match="checkpoints its own blocks already"):
        runner.fit([torch.randn(2, 8, 16)])
    assert not any(is_checkpointed(module) for module in model.modules())
