"""Two probe notes that misled: a shape error at a first trial of batch 1 (``strategy="binary"``)
got the BatchNorm / ``multiple_of=2`` note, and an embedding's index error at a first trial placed
by the estimate named a batch in the thousands with nothing saying why the search began there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import TrainStep, find_max_batch
from autobatch.probe.trial_notes import with_trial_note


def test_a_shape_error_at_a_first_trial_of_batch_one_gets_no_batchnorm_note():
    torch.manual_seed(0)
    model = nn.Linear(8, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(n: int) -> None:
        model(torch.randn(n, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
        find_max_batch(step, strategy="binary", memory_limit="16MiB", restore=(model, optimizer), cache=False)
    assert not any("BatchNorm" in note for note in getattr(caught.value, "__notes__", []))


def test_the_batch_one_note_stays_where_larger_sizes_ran_out_or_batchnorm_refused():
    batchnorm = ValueError("Expected more than 1 value per channel when training, got input size [1, 4]")
    assert "multiple_of=2" in with_trial_note(batchnorm, 1, failed=()).__notes__[0]  # binary's first trial
    came_down = with_trial_note(RuntimeError("shape '[0, 2, 8]' is invalid"), 1, failed=(2, 4))
    assert "multiple_of=2" in came_down.__notes__[0]
    assert not getattr(with_trial_note(RuntimeError("mat1 and mat2"), 1, failed=()), "__notes__", None)


def test_an_index_error_at_the_estimated_first_trial_says_the_estimate_placed_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 16), nn.Flatten(), nn.Linear(16 * 8, 2))
    step = TrainStep(model, torch.optim.Adam(model.parameters()),
                     lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                     lambda n: (torch.randint(0, 30, (n, 8)), torch.randint(0, 2, (n,))))  # ids past 9
    with pytest.raises(IndexError, match="index out of range in self") as caught:
        find_max_batch(step, memory_limit="16MiB", cache=False)
    (note,) = caught.value.__notes__
    size = int(note.split("first trial, at batch ")[1].split(" ")[0])
    estimated = int(note.split("a fake-tensor trace estimated, ")[1].split(";")[0])
    assert size > 8 and estimated >= size and "estimate_first=False" in note and "num_embeddings" in note
