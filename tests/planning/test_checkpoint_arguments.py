"""enable_checkpointing's arguments: a block's keywords named like checkpoint's own options,
targets that are not class names or classes, a target naming the model's own class, and a bare
string for ``modules``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autobatch
from autobatch.planning.checkpointing import enable_checkpointing, find_blocks, is_checkpointed

#: torch.utils.checkpoint's own keyword options
CHECKPOINT_OPTIONS = ("debug", "early_stop", "determinism_check", "context_fn", "use_reentrant")


class Block(nn.Module):
    """A block whose forward takes keywords that torch.utils.checkpoint also takes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[dict] = []

    def forward(self, x, *, debug=False, early_stop=False, determinism_check="default", context_fn=None,
                use_reentrant=None, scale=None):
        self.seen.append(dict(debug=debug, early_stop=early_stop, determinism_check=determinism_check,
                              context_fn=context_fn, use_reentrant=use_reentrant))
        out = self.fc(x) * (0.0 if early_stop else 1.0)
        return out if scale is None else out * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x, **options):
        for block in self.blocks:
            x = block(x, **options)
        return x.square().sum()


@pytest.mark.parametrize("options", [
    {"debug": True}, {"early_stop": True}, {"determinism_check": "none"}, {"context_fn": "mine"},
    {"use_reentrant": True}, {"scale": torch.tensor(2.0, requires_grad=True)},
])
def test_a_blocks_keywords_reach_it_even_named_like_checkpoints_options(options):
    """debug=True was eaten by checkpoint, early_stop=True changed nothing, use_reentrant was a
    TypeError ("got multiple values")."""
    torch.manual_seed(0)
    plain = Net()
    wrapped = copy.deepcopy(plain)
    x = torch.randn(3, 4)
    plain(x, **options).backward()
    handle = enable_checkpointing(wrapped)
    assert handle.modules == ["blocks.0", "blocks.1"]
    wrapped(x, **options).backward()
    for before, after in zip(plain.blocks, wrapped.blocks):
        given = {k: v for k, v in options.items() if k in CHECKPOINT_OPTIONS}
        assert all(seen[k] == v for seen in after.seen for k, v in given.items())  # forward and recompute alike
        assert len(after.seen) == 2  # once forward, once recomputed in backward
        assert torch.equal(before.fc.weight.grad, after.fc.weight.grad)


def deep_sequential(depth: int = 3) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)) for _ in range(depth)))


@pytest.mark.parametrize("targets", [[3], ["Block", 3.5], 3, [None]])
def test_targets_that_are_not_class_names_or_classes_are_one_type_error(targets):
    """[3] was an AttributeError ('int' object has no attribute '__name__')."""
    with pytest.raises(TypeError, match="checkpoint targets must be class names .* or classes"):
        find_blocks(Net(), targets)
    model = Net()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x),
                               lambda b: torch.randn(b, 4))
    with pytest.raises(TypeError, match="checkpoint targets must be class names"):
        autobatch.plan(step, global_batch=4, checkpoint_targets=targets)



@pytest.mark.parametrize("targets", [[], ()])
def test_no_targets_at_all_is_one_value_error_naming_none_and_allow_checkpointing(targets):
    """[] listed the model's classes as if a class name were misspelt."""
    model = Net()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x),
                               lambda b: torch.randn(b, 4))
    for call in (lambda: find_blocks(model, targets), lambda: enable_checkpointing(model, targets),
                 lambda: autobatch.plan(step, global_batch=4, checkpoint_targets=targets)):
        with pytest.raises(ValueError, match=r"checkpoint targets are empty: .* pass None .* allow_checkpointing=False"):
            call()
    assert not any(is_checkpointed(m) for m in model.modules())

def test_a_target_never_wraps_the_model_itself():
    """["Sequential"] on an nn.Sequential model wrapped the root: the whole model recomputed at once."""
    model = deep_sequential()
    assert find_blocks(model, ["Sequential"]) == ["0", "1", "2"]
    assert find_blocks(model, [nn.Sequential]) == ["0", "1", "2"]
    handle = enable_checkpointing(model, ["Sequential"])
    assert not is_checkpointed(model) and all(is_checkpointed(block) for block in model)
    handle.undo()
    with pytest.raises(ValueError, match="match no module of the model but the model itself"):
        find_blocks(Net(), ["Net"])


def test_a_bare_string_of_modules_is_one_name():
    """modules="10" wrapped blocks "1" and "0", its characters."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(12)))
    handle = enable_checkpointing(model, modules="10")
    assert handle.modules == ["10"]
    assert [name for name, module in model.named_modules() if is_checkpointed(module)] == ["10"]
