"""A make_batch that stops growing (a slice of a fixed dataset, ``X[:n]``) made every trial
above the dataset's size run the same batch: the probe answered the search ceiling (or
max_batch) with no word that it never ran that many samples. Now it is one ValueError naming
the sizes and what to change (:mod:`autobatch.probe.batch_growth`); padding is still taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, find_max_batch


def _step(make_batch):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     make_batch)


DATA = torch.randn(300, 16), torch.randint(0, 4, (300,))


def _sliced(n):
    return DATA[0][:n], DATA[1][:n]


@pytest.mark.parametrize("options", [{}, {"max_batch": 4096}, {"strategy": "binary", "max_batch": 1 << 14},
                                     {"strategy": "estimate", "max_batch": 4096}, {"strategy": "estimate"}])
def test_a_make_batch_that_stops_growing_is_refused_not_answered(options):
    """Before: 16777216 (the ceiling) or 4096 (max_batch) on a dataset of 300 samples."""
    step = _step(_sliced)
    weight = step.model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"make_batch stops growing: make_batch\((\d+)\) built the same batch as "
                                         r"make_batch\(\d+\) \(tensors of shapes \(300, 16\), \(300,\)\).*X\[:n\]") as caught:
        find_max_batch(step, memory_limit="4MiB", cache=False, **options)
    assert "\n" not in str(caught.value)
    assert torch.equal(step.model.weight, weight)  # the probe's restore still ran


def test_a_make_batch_that_pads_or_grows_past_the_check_still_answers():
    """Padding to a multiple of 32, or a dataset as large as max_batch, is no error."""
    padded = _step(lambda n: (torch.randn(-(-n // 32) * 32, 16), torch.randint(0, 4, (-(-n // 32) * 32,))))
    assert find_max_batch(padded, memory_limit="4MiB", cache=False, max_batch=130).batch_size == 130
    assert find_max_batch(_step(_sliced), memory_limit="4MiB", cache=False, max_batch=300).batch_size == 300
