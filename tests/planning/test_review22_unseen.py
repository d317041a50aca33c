"""plan() on model shapes its tests had not used (review 22): a sequence-first batch (``nn.MultiheadAttention``
with ``batch_first=False``) and a loss that is not a mean over samples (CLIP's contrastive loss over the batch).

Found running tiny Transformers models (T5, Wav2Vec2, CLIP, Mixtral, BERT) and plain ones under a simulated budget:
a batch of ``[T, n, E]`` inputs and ``[T, n]`` targets was planned (dim 0, the time steps, read as its samples) and
its micro-batches would cut the sequences; a tiny CLIP's plan of three micro-batches trained a gradient 14 off the
global batch's, with no note, where BatchNorm's inexact split gets one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import TrainStep, plan
from autobatch.planning.split_checks import LOSS_SPLIT, loss_split_note

OPTIONS = dict(memory_limit="16KiB", steps_per_trial=1, strategy="binary", cache=False)


class SeqFirst(nn.Module):
    """Attention over ``[T, B, E]`` (``batch_first=False``, the module's default), a label per position."""

    def __init__(self) -> None:
        super().__init__()
        self.attention, self.head = nn.MultiheadAttention(8, 2), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attention(x, x, x)[0])


def test_a_sequence_first_batch_is_refused_naming_the_dim_that_holds_the_samples():
    """make_batch(n) -> [12, n, 8] and [12, n]: dim 0 is 12 at every n. plan() read 12 samples and planned
    micro-batches that would cut the 12 time steps; now one error before any probe, naming dim 1."""
    torch.manual_seed(0)
    model = SeqFirst()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()),
                     lambda n: (torch.randn(12, n, 8), torch.randint(0, 3, (12, n))))
    with pytest.raises(ValueError, match=r"does not put its n samples on dim 0.*batch\[0\] grows on dim 1.*transpose"):
        plan(step, global_batch=32, **OPTIONS)


class Towers(nn.Module):
    """Two towers, as CLIP: image and text embeddings of each sample."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, images, texts):
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)


def contrastive(model, batch):
    """CLIP's loss: each sample's image against every text of the batch (in-batch negatives)."""
    images, texts = model(*batch)
    logits = images @ texts.T * 10
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def per_sample(model, batch):
    images, texts = model(*batch)
    return (images - texts).pow(2).sum(-1).mean()


@pytest.mark.parametrize("loss_fn, noted", [(contrastive, True), (per_sample, False)], ids=["contrastive", "mean"])
def test_a_split_of_a_loss_over_the_whole_batch_is_noted(loss_fn, noted, caplog):
    """The contrastive plan of 3 micro-batches said nothing; its gradient is another than one batch's. A mean of
    per-sample terms, split alike, gets no note."""
    torch.manual_seed(0)
    model = Towers()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                     lambda n: (torch.randn(n, 16), torch.randn(n, 16)))
    with caplog.at_level("WARNING", logger="autobatch"):
        result = plan(step, global_batch=64, **OPTIONS)
    assert result.accumulation_steps > 1
    found = [note for note in result.notes if note.startswith(LOSS_SPLIT)]
    assert bool(found) is noted and (LOSS_SPLIT in caplog.text) is noted
    if noted:
        assert "make_batch(8)" in found[0] and f"micro-batches of {result.micro_batch}" in found[0]


class Noisy(nn.Module):
    """Dropout, and a buffer its forward writes in any mode."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.drop(self.layer(x))


def test_the_check_puts_back_modes_buffers_and_random_state():
    """The check runs the loss three times in eval mode: the model's modes (a frozen part left in eval), its
    buffers and the random generators are as they were, so the plan and the run after it see no trace of it."""
    torch.manual_seed(0)
    model = Noisy()
    model.layer.eval()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(),
                     lambda n: torch.randn(n, 4))
    before = torch.get_rng_state()
    note = loss_split_note(step, [2, 2])
    assert note is not None and note.startswith(LOSS_SPLIT)  # a sum over samples: not their mean
    assert torch.equal(torch.get_rng_state(), before)
    assert model.training and not model.layer.training and model.drop.training
    assert model.calls.item() == 0
