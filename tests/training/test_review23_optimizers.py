"""A user with one optimizer per part of the model: a list of optimizers is one ``TypeError`` naming
param groups (it printed both optimizers whole and said only "must be a torch.optim.Optimizer");
the parameters an optimizer given alone leaves out, which still require grad, are named in one
warning (they got gradients every step, summed over the steps, never applied)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autobatch import Runner


def model_and_parts():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    return model, torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[1].parameters(), lr=1e-3)


def make(model, optimizer):
    return Runner(model, optimizer, lambda m, b: m(b).pow(2).mean(), global_batch=4, micro_batch=2, progress=False)


def test_a_list_of_optimizers_names_param_groups():
    model, first, second = model_and_parts()
    with pytest.raises(TypeError, match=r"got a list of 2 \(SGD, Adam\).*param groups") as info:
        make(model, [first, second])
    assert "Parameter Group" not in str(info.value)


def test_trainable_parameters_outside_the_optimizer_are_named(caplog):
    model, first, _ = model_and_parts()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        make(model, first).fit([torch.ones(4, 4)] * 2)
    warned = [r.getMessage() for r in caplog.records if "optimizer does not hold" in r.getMessage()]
    assert len(warned) == 1 and "1.weight, 1.bias" in warned[0]
    caplog.clear()
    model[1].requires_grad_(False)  # frozen on purpose: nothing to say
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        make(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    assert not [r for r in caplog.records if "optimizer does not hold" in r.getMessage()]


def test_review33_a_gans_optimizers_name_the_plain_callable_probe():
    """A GAN's user passes its two optimizers (a dict of them too: it printed both whole) to the Runner,
    a TrainStep or plan() (a plain callable: "it lacks model, ..." and no more): one TypeError each, naming
    the probe that takes such a step, find_max_batch(fn, restore=(gen, opt_g, disc, opt_d))."""
    import autobatch

    model, first, second = model_and_parts()
    wanted = "find_max_batch(fn, restore=(gen, opt_g, disc, opt_d))"
    for call in (lambda: make(model, {"g": first, "d": second}),
                 lambda: autobatch.TrainStep(model, [first, second], lambda m, b: m(b).mean(), lambda n: torch.ones(n, 4)),
                 lambda: autobatch.plan(lambda n: None, global_batch=8)):
        with pytest.raises(TypeError) as info:
            call()
        assert wanted in str(info.value) and "Parameter Group" not in str(info.value)
