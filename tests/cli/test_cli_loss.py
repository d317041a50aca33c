"""The CLI's loss reads logits from every common output form (tensor, ``.logits``, tuple)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.nn import functional as F

from autobatch.cli.build import cross_entropy_loss


@dataclass
class Output:  # the shape of a Hugging Face ModelOutput: logits as an attribute
    logits: torch.Tensor
    past_key_values: object = None


class Returns(torch.nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 5)
        self.wrap = wrap

    def forward(self, tokens):
        return self.wrap(self.embed(tokens))


@pytest.mark.parametrize("wrap", [lambda x: x, Output, lambda x: (x, None), lambda x: [x]], ids=["tensor", "logits", "tuple", "list"])
def test_the_loss_reads_logits_from_each_output_form(wrap):
    torch.manual_seed(0)
    model = Returns(wrap)
    tokens, targets = torch.randint(0, 11, (3, 4)), torch.randint(0, 5, (3, 4))
    expected = F.cross_entropy(model.embed(tokens).reshape(-1, 5), targets.reshape(-1))
    assert torch.allclose(cross_entropy_loss(model, (tokens, targets)), expected)


def test_an_output_without_logits_names_what_to_change():
    model = Returns(lambda x: {"hidden": x})
    with pytest.raises(TypeError, match=r"returned dict, not logits.*\.logits"):
        cross_entropy_loss(model, (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)))
