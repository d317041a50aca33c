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
