"""A plain callable that trains two models (a GAN): a further module or optimizer in ``restore``
is put back whole, gradients and weights included, not only by its state dict (review 13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autobatch


def _gan():
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    disc = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)

    def step(batch_size: int) -> float:  # the discriminator steps first, then the generator
        fake = gen(torch.randn(batch_size, 8))
        opt_d.zero_grad()
        (F.softplus(-disc(torch.randn(batch_size, 16))).mean() + F.softplus(disc(fake.detach())).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        loss = F.softplus(-disc(fake)).mean()
        loss.backward()  # leaves gradients on the discriminator too
        opt_g.step()
        return loss.item()

    return gen, disc, opt_g, opt_d, step


def _state(module, optimizer):
    return ({k: v.clone() for k, v in module.state_dict().items()}, [p.grad for p in module.parameters()],
            optimizer.state_dict()["state"])


def _same(before, after) -> bool:
    (tensors, grads, state), (tensors2, grads2, state2) = before, after
    return (all(torch.equal(tensors[k], tensors2[k]) for k in tensors) and grads == grads2 == [None] * len(grads)
            and str(state) == str(state2))


def test_a_further_module_and_optimizer_are_put_back_whole():
    gen, disc, opt_g, opt_d, step = _gan()
    before = _state(disc, opt_d)
    autobatch.find_max_batch(step, memory_limit="1MiB", restore=(gen, opt_g, disc, opt_d), cache=False)
    assert _same(before, _state(disc, opt_d))  # the discriminator's gradients were left before


def test_a_further_optimizer_without_its_module_puts_its_weights_back_and_says_what_it_cannot():
    gen, disc, opt_g, opt_d, step = _gan()
    weights = [p.clone() for p in disc.parameters()]
    with pytest.warns(RuntimeWarning, match=r"restore\[2\] trains parameters that no module in restore holds"):
        autobatch.find_max_batch(step, memory_limit="1MiB", restore=(gen, opt_g, opt_d), cache=False)
    assert all(torch.equal(a, b) for a, b in zip(weights, disc.parameters()))  # trained for real before
