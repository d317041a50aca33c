"""A runner, its model and its optimizer are freed at ``del``, not at the garbage collector's next
full collection (review 38). The runner handed its own bound methods to the tenacity loop and the
step guard it holds (cycles), so a notebook that built a second runner to train again kept the
first one's weights and optimizer state on the device, and the second one's plan measured that
much less. Its TrainStep's ``make_batch`` was also a method (another cycle), and the one it named
was shadowed in the runner's bases by the empty-data error, which returned where it should raise."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autobatch
from autobatch import FaultInjector


def _freed_at_del(**options) -> bool:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    runner = autobatch.Runner(model, optimizer, lambda m, b: F.cross_entropy(m(b[0]), b[1]), global_batch=8, **options)
    runner.fit(data, epochs=1)
    held = weakref.ref(model)
    del model, optimizer, runner
    return held() is None


def test_review38_a_runner_is_freed_at_del_after_fit_and_a_replay():
    enabled = gc.isenabled()
    gc.disable()  # a collection in between would hide the cycle
    try:
        assert _freed_at_del(micro_batch=8)
        assert _freed_at_del(micro_batch=8, faults=FaultInjector([(1, "backward")]))  # the retry loop ran
    finally:
        if enabled:
            gc.enable()
    model = nn.Linear(2, 2)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(),
                              global_batch=2, micro_batch=2)
    with pytest.raises(RuntimeError, match="takes its batches from the data"):
        runner._train_step.make_batch(2)
