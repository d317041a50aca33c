"""A token mean over padded sequences, split: plan()'s note names the fix, and the fix is exact.

``cross_entropy(ignore_index=-100)`` (``reduction="mean"``) over micro-batches holding different
numbers of real tokens trains another gradient than one batch's. plan() notes it; the note used to
point at a "Gradient accumulation" section docs/planning.md does not have, and named no recipe.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autobatch
from autobatch.planning.split_checks import LOSS_SPLIT

V, T, B = 11, 6, 8
LENGTHS = torch.tensor([6, 1, 2, 6, 1, 1, 6, 3])  # real tokens per sample


def lm_batch(size: int = B) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = torch.arange(size) % B
    ids = torch.randint(0, V, (B, T), generator=g)[rows]
    labels = ids.masked_fill(torch.arange(T)[None] >= LENGTHS[rows][:, None], -100)
    tokens = (labels != -100).sum()
    return {"ids": ids, "labels": labels, "token_weight": torch.full((size,), size / tokens.item(), dtype=torch.float64)}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, V)).double()


def token_mean(net: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(net(batch["ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def token_weighted(net: nn.Module, batch: dict) -> torch.Tensor:
    """docs/runner.md's token_weight recipe: a mean over samples, equal to the batch's token mean."""
    per_token = F.cross_entropy(net(batch["ids"]).transpose(1, 2), batch["labels"], ignore_index=-100, reduction="none")
    return (per_token.sum(dim=1) * batch["token_weight"]).mean()


def test_the_note_on_a_split_token_mean_names_the_recipe_and_a_section_that_exists():
    net = model()
    step = autobatch.TrainStep(net, torch.optim.SGD(net.parameters(), lr=0.1), token_mean, lm_batch)
    notes = [note for note in autobatch.plan(step, global_batch=B, max_batch=4).notes if note.startswith(LOSS_SPLIT)]
    assert len(notes) == 1 and "token_weight" in notes[0]
    section = notes[0].rsplit("docs/planning.md, '", 1)[1].split("'")[0]
    with open("docs/planning.md", encoding="utf-8") as doc:
        text = doc.read()
    assert f"**{section}.**" in text or f"# {section}" in text, section


def test_the_token_weight_recipe_accumulates_the_token_mean_exactly_however_cut():
    net, batch = model(), lm_batch()
    net.zero_grad()
    token_mean(net, batch).backward()  # one batch's mean over its 26 real tokens
    whole = [p.grad.clone() for p in net.parameters()]
    for micro in (4, 3):  # equal and unequal pieces of different token counts
        net.zero_grad()
        autobatch.accumulate_gradients(net, token_mean, batch, micro)
        naive = [p.grad.clone() for p in net.parameters()]
        assert max((a - b).abs().max().item() for a, b in zip(naive, whole)) > 1e-3  # the plain token mean is off
        net.zero_grad()
        autobatch.accumulate_gradients(net, token_weighted, batch, micro)
        assert all(torch.allclose(p.grad, w, rtol=1e-10, atol=1e-12) for p, w in zip(net.parameters(), whole))
