"""A step with two models (a GAN's generator and discriminator in one plain callable) restored as
``restore=(G, D, opt_G, opt_D)`` is one ``TypeError`` that shows the form the probe takes, each
further model or optimizer after the first pair (``restore=(G, opt_G, D, opt_D)``); before, it read
"restore[1] must be a torch.optim.Optimizer, got Linear Linear(in_features=..." and no more."""

import pytest
import torch

import autobatch


def test_second_model_in_optimizer_place_names_the_form():
    gen, disc = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    with pytest.raises(TypeError) as info:
        autobatch.find_max_batch(lambda n: None, restore=(gen, disc, opt_g, opt_d), max_batch=2)
    text = str(info.value)
    assert "restore[1]" in text and "restore=(G, opt_G, D, opt_D)" in text


def test_review33_gan_toggle_put_back_after_failed_trial():
    """A GAN step freezes the discriminator for the generator's loss and unfreezes it after; a trial
    that ran out of memory in between left it frozen, and the next trial's discriminator loss raised
    "element 0 of tensors does not require grad" (the probe blamed a size the step refuses). Each
    trial starts with every parameter's ``requires_grad`` as the probe found it, and so does training."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    gen.bias.requires_grad_(False)  # frozen by the user: stays frozen
    opt_g, opt_d = torch.optim.Adam([gen.weight]), torch.optim.Adam(disc.parameters())

    def step(n):
        fake = gen(torch.randn(n, 4))
        opt_d.zero_grad()
        (disc(torch.randn(n, 8)).mean() - disc(fake.detach()).mean()).backward()
        opt_d.step()
        disc.requires_grad_(False)  # the generator's step
        loss = -disc(fake).mean()
        torch.empty(n * 4000)  # its memory: the failed trials run out here, disc frozen
        opt_g.zero_grad()
        loss.backward()
        opt_g.step()
        disc.requires_grad_(True)

    with autobatch.simulated_memory("1MiB"):
        result = autobatch.find_max_batch(step, restore=(gen, opt_g, disc, opt_d), strategy="binary")
    assert result.batch_size > 4
    assert all(p.requires_grad for p in disc.parameters()) and gen.weight.requires_grad
    assert not gen.bias.requires_grad
