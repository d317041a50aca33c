"""``repr`` of an estimate is one line with its answer, as a probe's result is: listing every
traced ``MemoryEstimate`` made about a kilobyte. The traces stay in ``to_dict()``."""

from __future__ import annotations

import torch
from torch.nn import functional as F

import autobatch


def test_an_estimate_repr_is_one_short_line_with_the_answer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    step = autobatch.TrainStep(model, torch.optim.Adam(model.parameters()), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))
    estimate = autobatch.estimate_max_batch(step, "1MiB")
    text = repr(estimate)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith(f"BatchEstimate(batch_size={estimate.batch_size}, ") and "of 1.00 MiB" in text
    assert len(estimate.to_dict()["estimates"]) == len(estimate.estimates) > 1  # the traces are all kept there
