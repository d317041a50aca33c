"""An estimate's fake copy of the optimizer is not a stepped optimizer ``restore`` lacks
(``autobatch.probe.snapshot.unrestored``): a trace that gave up kept its fake step alive in the saved
error's traceback, and Transformers' ``fit_batch_size`` on a tiny GPT-2 warned "the probe's trials
stepped an optimizer that restore does not hold (AdamW)", advice it cannot follow, with the
weights put back exactly (found by the integrations round)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autobatch.probe.snapshot.unrestored import trained_for_real_note, warn_unrestored_optimizers


def test_a_fake_optimizer_is_neither_warned_about_nor_noted():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FakeTensorMode():
        fake = torch.optim.AdamW([nn.Parameter(torch.empty(4, 2))])
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # a real one restore lacks: still warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_unrestored_optimizers([fake], restore=(model, optimizer))
        assert not caught
        warn_unrestored_optimizers([fake, other], restore=(model, optimizer))
    assert len(caught) == 1 and "(SGD)" in str(caught[0].message)
    assert trained_for_real_note([fake], restore=None) is None
