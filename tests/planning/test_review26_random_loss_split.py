"""plan()'s split check on losses that draw random numbers in eval mode (review 26).

A VAE's reparameterisation (``mu + torch.randn_like(mu) * std``) and a model injecting noise in its
forward draw random numbers whatever the mode, so the check's three losses (``make_batch(2)`` and its
halves) saw three different draws: a VAE whose loss is a mean of per-sample terms was told "The loss is
not a mean over samples" (14.97 against halves 14.5 and 18.03). Such a loss cannot be checked by
comparing single draws: now no note, while a contrastive loss that also draws noise is still noted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import TrainStep
from autobatch.planning.split_checks import LOSS_SPLIT, loss_split_note


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 8), nn.Linear(4, 8)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()  # reparameterisation: random in eval mode too
        return self.dec(z), mu, logvar


def elbo(model, x):
    """A mean over samples of (reconstruction + KL): accumulation keeps it."""
    recon, mu, logvar = model(x)
    kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(-1)
    return (F.mse_loss(recon, x, reduction="none").sum(-1) + kl).mean()


def noisy_contrastive(model, x):
    """In-batch negatives on noisy embeddings: not a mean over samples, random or not."""
    recon, mu, _ = model(x)
    logits = F.normalize(recon, dim=-1) @ F.normalize(x, dim=-1).T * 20
    return F.cross_entropy(logits, torch.arange(len(x)))


@pytest.mark.parametrize("loss_fn, noted", [(elbo, False), (noisy_contrastive, True)], ids=["vae", "contrastive"])
def test_a_loss_that_draws_random_numbers_is_noted_only_where_it_is_not_a_mean(loss_fn, noted):
    torch.manual_seed(0)
    model = VAE()
    step = TrainStep(model, torch.optim.Adam(model.parameters()), loss_fn, lambda n: torch.randn(n, 8) * 3)
    before = torch.get_rng_state()
    notes = [loss_split_note(step, [2, 2]) for _ in range(5)]  # each check draws other noise
    assert torch.equal(torch.get_rng_state(), before)
    assert all((note is not None and note.startswith(LOSS_SPLIT)) is noted for note in notes), notes
