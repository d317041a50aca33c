"""A loss that is no mean over samples, at the Runner's first change of split (review 32).

The runner weights each micro-batch's loss by its share of the samples: exact for a mean over
samples only. With ``reduction='sum'`` a given split trains a steady update, but an OOM replay's
smaller pieces halve it, without a word (``plan()`` checked the loss before it split; the Runner
never did). Now the first attempt cut otherwise than the run's first reads the ``loss_fn``, without
calling it, and warns once where it shows a sum or class weights; what the run trains, and how
often ``loss_fn`` is called, are unchanged."""

from __future__ import annotations

import logging

import torch
from torch import nn

import autobatch
from autobatch.planning.split_checks import LOSS_SPLIT

SUMMED = nn.CrossEntropyLoss(reduction="sum")
MEAN = nn.CrossEntropyLoss()
WEIGHTED = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 1.0]))


def summed_mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1], reduction="sum")


def mean_of_sum(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1], reduction="sum") / len(b[0])  # a mean over samples


def run(loss_fn, caplog, *, oom=True, check=True, **options):
    """Three steps of a tiny net, an OOM injected in step 1's backward: the loss warnings, the
    number of loss_fn calls, and the trained weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 3))
    calls = []
    regression = loss_fn in (summed_mse, mean_of_sum)
    data = [(torch.randn(8, 4), torch.randn(8, 3) if regression else torch.randint(0, 3, (8,))) for _ in range(3)]
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.01),
                              lambda m, b: calls.append(len(b[0])) or loss_fn(m, b), global_batch=8,
                              progress=False, log_every=None, **{"grow_after": None, **options})
    runner._told_loss_split = not check
    if oom:
        autobatch.inject_oom(runner, at=(1, "backward"))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(LOSS_SPLIT)]
    caplog.clear()
    return said, calls, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_review32_a_sum_loss_replay_warns_once_and_trains_the_same(caplog):
    said, calls, weights = run(summed_mse, caplog, micro_batch=8)
    assert len(said) == 1, said
    assert "summed_mse() calls with reduction='sum'" in said[0] and "from step 1 on" in said[0], said
    assert "micro-batches of 4 (an OOM recovery's smaller ones) where the run trained micro-batches of 8" in said[0]
    assert "token_weight" in said[0], said
    assert calls == [8, 8, 4, 4, 4, 4]  # the failed attempt's, the replay's, step 2's: no call of a check
    unsaid, _, unchecked = run(summed_mse, caplog, check=False, micro_batch=8)
    assert not unsaid and torch.equal(weights, unchecked)  # nothing the run trained changed


def test_review32_a_loss_module_is_read_where_the_loss_fn_names_it(caplog):
    said, _, _ = run(lambda m, b: SUMMED(m(b[0]), b[1]), caplog, micro_batch=4)  # split from the start, halved
    assert len(said) == 1 and "SUMMED = CrossEntropyLoss(reduction='sum')" in said[0], said
    said, _, _ = run(lambda m, b: WEIGHTED(m(b[0]), b[1]), caplog, micro_batch=8)
    assert len(said) == 1 and "with unequal class weights" in said[0], said
    for mean in (lambda m, b: MEAN(m(b[0]), b[1]), mean_of_sum):  # means over samples: nothing said
        said, _, _ = run(mean, caplog, micro_batch=8)
        assert not said, said


def test_review32_grow_back_changes_the_split_too(caplog):
    said, _, _ = run(summed_mse, caplog, oom=False, micro_batch=2, max_micro_batch=8, grow_after=1)
    assert len(said) == 1, said
    assert "micro-batches of 4 (grow-back's larger ones) where the run trained micro-batches of 2" in said[0], said
    said, _, _ = run(summed_mse, caplog, oom=False, micro_batch=4)  # never changes its split: nothing read or said
    assert not said, said
