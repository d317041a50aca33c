"""plan()'s check for a loss that is no mean over samples, on token means it used to miss (review 39).

A token mean over padded sequences (``(per_token * mask).sum() / mask.sum()``) weights each sample by its
real tokens, so accumulated micro-batches train another gradient than one batch. The check compared the
loss on ``make_batch(2)`` with its halves' to 1e-3 of it: two samples of one length agree exactly, and an
untrained model's per-token losses are all about ``log V``, so the weights moved the loss by less than
1e-3 (a token model, 2 to 12 real tokens of 12, was noted on 32 of 40 seeds). Now groups of two cuts of
``make_batch(8)`` are each held against their samples' mean, to 1e-5 in float32: 40 of 40, and no note
for losses that are means over samples."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from autobatch import TrainStep
from autobatch.planning.split_checks import LOSS_SPLIT, loss_split_note

V, T = 64, 12


def per_token(model, batch):
    return F.cross_entropy(model(batch["ids"]).transpose(1, 2), batch["labels"], reduction="none")


def token_mean(model, batch):
    """Weighted by real tokens: no mean over samples."""
    mask = batch["mask"].float()
    return (per_token(model, batch) * mask).sum() / mask.sum()


def per_sample_token_means(model, batch):
    mask = batch["mask"].float()
    return ((per_token(model, batch) * mask).sum(1) / mask.sum(1)).mean()


def per_sample_sums(model, batch):
    return (per_token(model, batch) * batch["mask"].float()).sum(1).mean()


def token_batches(lengths):
    def make_batch(n):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, V, (n, T), generator=g)
        return {"ids": ids, "labels": ids.roll(-1, 1), "mask": torch.arange(T)[None] < torch.tensor(lengths[:n])[:, None]}
    return make_batch


def notes(make_batch, std=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, V))
    if std is not None:  # an untrained model's near-uniform logits: every token's loss about log V
        nn.init.normal_(model[1].weight, std=std)
        nn.init.zeros_(model[1].bias)
    found = {}
    for loss_fn in (token_mean, per_sample_token_means, per_sample_sums):
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, make_batch)
        found[loss_fn.__name__] = loss_split_note(step, [2, 2])
    return found


def test_review39_a_token_mean_is_noted_where_the_first_two_samples_have_one_length():
    found = notes(token_batches([7, 7, 2, 12, 3, 9, 5, 11]))
    assert found["token_mean"] is not None and found["token_mean"].startswith(LOSS_SPLIT)
    assert found["per_sample_token_means"] is None and found["per_sample_sums"] is None


def test_review39_a_token_mean_of_nearly_equal_token_losses_is_noted():
    found = notes(token_batches([2, 12, 4, 10, 6, 8, 3, 11]), std=0.003)
    assert found["token_mean"] is not None and found["token_mean"].startswith(LOSS_SPLIT)
    assert found["per_sample_token_means"] is None and found["per_sample_sums"] is None


def test_review39_float32_on_an_accelerator_that_may_round_to_tf32_keeps_the_wider_tolerance(monkeypatch):
    """On CUDA, float32 convolutions round to TF32 by default and kernels follow the batch's shape:
    1e-3 there, 1e-5 only with both TF32 switches off (and on the CPU), 2e-2 under 16 bits."""
    from types import SimpleNamespace

    from autobatch.planning import split_checks

    def step(device, dtype=torch.float32, autocast=None):
        param = SimpleNamespace(dtype=dtype, device=torch.device(device))
        return SimpleNamespace(model=SimpleNamespace(parameters=lambda: [param]), autocast_dtype=autocast)

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert split_checks._tolerance(step("cuda")) == 1e-3 and split_checks._tolerance(step("cpu")) == 1e-5
    assert split_checks._tolerance(step("cuda", autocast=torch.bfloat16)) == 2e-2
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert split_checks._tolerance(step("cuda")) == (1e-3 if torch.backends.cuda.matmul.allow_tf32 else 1e-5)
