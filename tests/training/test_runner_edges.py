"""Inputs the runner trained wrong, or took silently: each is now trained as asked or one error.

A list of per-sample items (``collate_fn=list``) was read by its items' own size and split
along the wrong dimension; ``min_micro_batch=2`` still cut an odd global batch into a last piece
of 1; a plan's ``multiple_of`` split was reported but not trained; ``fit((x, y))`` trained ``x``
and ``y`` as two batches; ``checkpoint_every`` without ``checkpoint_dir`` wrote nothing; and
``device="cuda"`` without CUDA failed at the first transfer with torch's bare AssertionError.
"""

from __future__ import annotations

import collections
import itertools
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import autobatch
from autobatch import Runner
from autobatch.planning.accumulation import batch_size_of, micro_batch_sizes, split_batch
from runner_workloads import make_data, make_model, mse

PER_SAMPLE = "per-sample items.*default_collate.*\\(list, tensor\\) batch"


def _runner(model: nn.Module | None = None, loss_fn=mse, **options) -> Runner:
    model = model if model is not None else make_model()
    options = {"global_batch": 16, "micro_batch": 4, "progress": False, "log_every": None, **options}
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, **options)


# -- a list of per-sample items ----------------------------------------------------------------
def test_a_list_of_per_sample_tuples_is_one_error_naming_the_forms_to_pass():
    """DataLoader(collate_fn=lambda s: s) over (x, y) samples: read as 2 samples (each tuple's
    length), split into x's and y's after an OOM."""
    samples = [(torch.randn(6, dtype=torch.float64), torch.randn(1, dtype=torch.float64)) for _ in range(32)]
    with pytest.raises(ValueError, match=PER_SAMPLE):
        batch_size_of(samples[:16])
    loader = DataLoader(samples, batch_size=16, collate_fn=lambda items: items)
    with pytest.raises(ValueError, match=PER_SAMPLE):
        _runner().fit(loader)


def test_a_list_of_per_sample_token_tensors_is_one_error():
    """DataLoader(collate_fn=list) over 16 sequences of 8 tokens: read as 8 samples, every
    sequence cut along its tokens, with only a warning."""
    sequences = [torch.randint(0, 50, (8,)) for _ in range(16)]
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
    seen = []

    def lm_loss(m, batch):
        seen.append(len(batch))
        tokens = torch.stack(batch)
        return nn.functional.cross_entropy(m(tokens[:, :-1]).reshape(-1, 50), tokens[:, 1:].reshape(-1))

    with pytest.raises(ValueError, match="as many as the global batch's 16 samples, which reads as 8.*" + PER_SAMPLE):
        _runner(model, lm_loss).fit(DataLoader(sequences, batch_size=16, collate_fn=list))
    assert seen == []


def test_per_sample_items_beside_a_tensor_and_the_collates_still_split():
    """The forms the error advises, and those read before, are split per sample as they were."""
    items = [(torch.randn(6), torch.randn(1)) for _ in range(16)]
    batch = (items, torch.arange(16))  # a (list, tensor) batch
    assert batch_size_of(batch) == 16
    assert [piece[0] for piece in split_batch(batch, 4)][1] == items[4:8]
    targets = tuple({"boxes": torch.randn(k, 4)} for k in (1, 3, 2, 5))
    images = tuple(torch.randn(3, 8 + i, 8) for i in range(4))  # torchvision's tuple(zip(*batch)), as a list too
    assert batch_size_of((images, targets)) == batch_size_of([images, targets]) == 4
    short = [torch.randn(3, 6), torch.randn(3, 1)]  # a short last batch of (inputs, targets): a warning, as before
    runner = _runner(loss_fn=lambda m, b: mse(m, (b[0].double(), b[1].double())), global_batch=2, micro_batch=2)
    runner.fit([[torch.randn(2, 6), torch.randn(2, 1)], short])
    assert runner.result.samples == 5


# -- min_micro_batch and an odd global batch ----------------------------------------------------
def test_no_piece_is_smaller_than_min_micro_batch():
    assert micro_batch_sizes(15, 2, balanced=True) == [2] * 7 + [1]  # unchanged without the floor
    assert micro_batch_sizes(15, 2, balanced=True, min_micro_batch=2) == [3] + [2] * 6
    assert micro_batch_sizes(17, 8, min_micro_batch=2) == [6, 6, 5]
    for total, micro, floor, balanced in itertools.product(range(1, 40), range(1, 12), range(1, 12), (False, True)):
        if floor > micro:
            continue
        try:
            sizes = micro_batch_sizes(total, micro, balanced=balanced, min_micro_batch=floor)
        except ValueError as error:
            assert f"global_batch={total}" in str(error) and f"min_micro_batch={floor}" in str(error)
            assert total < floor * (floor - 1)  # a batch of at least floor * (floor - 1) samples always splits
            continue
        assert sum(sizes) == total and max(sizes) <= micro + 1 and (min(sizes) >= floor or sizes == [total])


def test_a_batchnorm_run_with_min_micro_batch_2_never_trains_one_sample():
    """Global batch 15, two OOMs at step 1 (8 -> 4 -> 2): the balanced split of 15 by 2 ended in
    a piece of 1, and BatchNorm raised at it despite min_micro_batch=2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)).double()
    pieces = []

    def loss_fn(m, batch):
        pieces.append(len(batch[0]))
        return mse(m, batch)

    runner = _runner(model, loss_fn, global_batch=15, micro_batch=8, min_micro_batch=2, grow_after=None,
                     faults=autobatch.FaultInjector([(1, "forward")], times=2))
    result = runner.fit(make_data(samples=45, global_batch=15))
    assert result.steps == 3 and min(pieces) >= 2 and runner.micro_batch == 2
    assert pieces[-7:] == [3, 2, 2, 2, 2, 2, 2]


def test_a_global_batch_min_micro_batch_cannot_cut_is_one_error():
    with pytest.raises(ValueError, match="global_batch=11 cannot be cut.*min_micro_batch=4.*min_micro_batch to 3"):
        _runner(global_batch=11, micro_batch=8, min_micro_batch=4)


# -- a plan's split is the one trained ----------------------------------------------------------
def test_the_trained_split_is_the_plans_with_multiple_of():
    """plan() chose 104 x 9 + 64 (multiples of 8, balanced=False); the runner trained 100 x 10."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    sizes = []

    def loss_fn(m, batch):
        sizes.append(batch[0].shape[0])
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    options = {"memory_limit": "1500KiB", "strategy": "binary", "multiple_of": 8, "cache": False}
    runner = _runner(model, loss_fn, global_batch=1000, micro_batch=None, grow_after=None, plan_options=options)
    steps = []
    result = runner.fit([(torch.randn(1000, 32), torch.randint(0, 10, (1000,)))], on_step_end=steps.append)
    assert sizes[-steps[0]["accumulation"]:] == result.plan["micro_batch_sizes"]
    assert all(size % 8 == 0 for size in result.plan["micro_batch_sizes"][:-1]) and not runner.balanced


# -- arguments that trained nothing, or failed later ---------------------------------------------
def test_one_batch_passed_as_a_tuple_of_tensors_is_refused():
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    Pair = collections.namedtuple("Pair", "x y")
    for data in ((x, y), Pair(x, y)):
        with pytest.raises(TypeError, match=r"got (tuple|Pair) of tensors; to train on one batch, pass \[batch\]"):
            _runner().fit(data)
    result = _runner(loss_fn=lambda m, b: m(b).pow(2).mean()).fit([x, x])  # a list of tensor batches is data
    assert result.steps == 2


def test_checkpoint_every_without_checkpoint_dir_is_one_error():
    with pytest.raises(ValueError, match="checkpoint_every=1 needs checkpoint_dir"):
        _runner(checkpoint_every=1)
    _runner(checkpoint_every=0)  # 0: off, as before


def test_a_device_this_machine_lacks_is_refused_when_the_runner_is_made(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda': this machine has no cuda device"):
        _runner(device="cuda")


def test_the_size_warning_still_comes_for_a_short_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        _runner().fit(make_data(samples=40))  # 16, 16, 8
    assert "a batch of 8 samples, not 16" in caplog.text
