"""plan() on model shapes its authors did not build it on: blocks held as attributes, Transformers outputs
that carry (or do not carry) a key/value cache, and checkpoint targets given as the model's own modules.

Found trying torchvision and tiny Transformers models under a simulated budget: a model whose blocks no
container holds, where micro-batch 1 fits alone but not beside the first one's gradients, got an error that
named neither checkpointing nor ``checkpoint_targets`` (naming the class then fits it); BERT, and Llama, T5
and Whisper layers checkpointed by Transformers 5's protocol (which build no cache, or an empty one), were
told to set ``use_cache = False`` "(more fits)"; ``checkpoint_targets=model.layers`` was a ``TypeError``
quoting the ModuleList's repr, and a pattern (``"layers.*"``) or a lower-case class name an error that listed
the classes as if one were misspelt.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autobatch import NoBatchFitsError, TrainStep, plan
from autobatch.planning.checkpointing import find_blocks
from test_review18_own_checkpointing import Layer

WIDTH = 16


class Blk(Layer):
    """The review-18 layer (a key/value cache it may fill), under a class name of its own."""

    def __init__(self) -> None:
        super().__init__(WIDTH)


class Attributes(nn.Module):
    """Blocks as attributes, run from a plain list: no container holds them, so none is found automatically."""

    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1, self.b2, self.b3 = (Blk() for _ in range(4))

    def forward(self, x):
        for block in (self.b0, self.b1, self.b2, self.b3):
            x = block(x)
        return x.pow(2).mean()


def step_of(model: nn.Module, make_batch=lambda n: torch.randn(n, 32, WIDTH)) -> TrainStep:
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x), make_batch)


def test_an_accumulated_step_that_fits_no_micro_batch_names_the_block_classes_to_target():
    """Under 80 KiB micro-batch 1 fits in one step, not beside the first one's gradients; the error said only
    "try lower precision ... a larger memory_limit". Naming the class it now gives fits 1 x 4."""
    options = dict(global_batch=4, memory_limit="80KiB", steps_per_trial=1, strategy="binary")
    torch.manual_seed(0)
    with pytest.raises(NoBatchFitsError) as caught:
        plan(step_of(Attributes()), **options)
    message = str(caught.value)
    assert "but not the global batch" in message and "checkpoint_targets=['Blk']" in message
    assert [probe["fits"] for probe in caught.value.attempts] == [True, False]  # one step fits, accumulated not
    fitted = plan(step_of(Attributes()), checkpoint_targets=["Blk"], **options)
    assert fitted.checkpointing and fitted.micro_batch_sizes == [1, 1, 1, 1]


class Output(dict):
    """A Transformers ``ModelOutput`` as the planner sees it: a mapping from ``transformers.*`` that leaves
    out its None fields (importing Transformers and building a model takes seconds)."""


Output.__module__ = "transformers.modeling_outputs"


class LM(nn.Module):
    """``config.use_cache`` True; ``fills``: whether the cache it returns holds the layers' keys (GPT-2's
    blocks, handed it positionally) or is left out (BERT builds none; Llama's protocol layers drop it)."""

    def __init__(self, fills: bool) -> None:
        super().__init__()
        self.config, self.fills = SimpleNamespace(use_cache=True), fills
        self.layers = nn.ModuleList(Blk() for _ in range(4))

    def forward(self, x):
        cache = [] if self.fills else None
        for layer in self.layers:
            x = layer(x, cache)
        return Output(loss=x.pow(2).mean(), **({"cache": [(key, key) for key in cache]} if self.fills else {}))


@pytest.mark.parametrize("fills", [True, False])
def test_the_use_cache_advice_is_given_only_where_the_forward_hands_back_a_cache(fills):
    """Under 80 KiB the model that keeps no cache plans 1 x 2 with checkpointing, with no advice to turn the
    cache off (it had it); the one whose cache holds every layer's activations fits nothing, and is told."""
    torch.manual_seed(0)
    model = LM(fills)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x)["loss"],
                     lambda n: torch.randn(n, 32, WIDTH))
    options = dict(global_batch=2, memory_limit="80KiB", steps_per_trial=1, strategy="binary")
    if fills:
        with pytest.raises(NoBatchFitsError, match=r"Try model.config.use_cache = False"):
            plan(step, **options)
        return
    planned = plan(step, **options)
    assert planned.checkpointing and planned.micro_batch_sizes == [1, 1]
    assert not any("use_cache" in note for note in planned.notes)


def test_checkpoint_targets_take_the_models_own_modules_and_say_what_a_pattern_or_case_means():
    model = Attributes()
    model.layers = nn.ModuleList(Blk() for _ in range(2))
    assert find_blocks(model, model.layers) == ["layers.0", "layers.1"]  # a container: its entries
    assert find_blocks(model, [model.layers]) == ["layers.0", "layers.1"]  # in a list too (it wrapped the container)
    assert find_blocks(model, [model.b1, model.b3]) == ["b1", "b3"]
    assert find_blocks(model, model.b2) == ["b2"]
    for targets, said in [(copy.deepcopy(model).layers, "another copy"), ("layers.*", "not patterns: what 'layers.*' "
                          "matches is of the classes 'Blk'"), ("*lk", "classes 'Blk'"), ("blk", "'Blk' for 'blk'")]:
        with pytest.raises(ValueError, match="match no module of the model") as caught:
            find_blocks(model, targets)
        assert said in str(caught.value)
    del model.layers
    planned = plan(step_of(model), global_batch=4, memory_limit="80KiB", steps_per_trial=1, strategy="binary",
                   checkpoint_targets=[model.b0, model.b1, model.b2, model.b3])
    assert planned.checkpointed_modules == ["b0", "b1", "b2", "b3"] and planned.micro_batch_sizes == [1, 1, 1, 1]
