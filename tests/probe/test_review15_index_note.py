"""A make_batch that indexes a dataset of fewer samples raises IndexError at a large trial: its note
says max_batch (or repeating samples), not multiple_of, which the size-refusal note advised."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, find_max_batch


def test_an_index_out_of_range_names_max_batch():
    data, labels = torch.randn(100, 16), torch.randint(0, 4, (100,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
                     lambda n: (data[torch.arange(n)], labels[torch.arange(n)]))
    with pytest.raises(IndexError, match="out of bounds") as caught:
        find_max_batch(step, memory_limit="4MiB", cache=False, estimate_first=False)
    note = " ".join(caught.value.__notes__)
    assert "max_batch=len(dataset)" in note and "multiple_of" not in note


def test_an_index_out_of_range_in_a_trace_names_max_batch():
    samples = [(torch.randn(16), k % 4) for k in range(100)]
    model = torch.nn.Linear(16, 4)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
                     lambda n: (torch.stack([samples[k][0] for k in range(n)]), torch.tensor([samples[k][1] for k in range(n)])))
    with pytest.raises(IndexError, match="list index out of range") as caught:
        find_max_batch(step, memory_limit="4MiB", cache=False, strategy="estimate")
    note = " ".join(caught.value.__notes__)
    assert "max_batch=len(dataset)" in note and "multiple_of" not in note
