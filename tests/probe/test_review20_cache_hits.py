"""A cache hit and memory held beside the step (:mod:`autobatch.probe.caching.cache_hits`): the key holds
the device and its capacity, not what this process keeps outside the step when it asks (another
model, tensors made inside the ``simulated_memory`` block), and a hit handed back an emptier
device's answer, which runs out of memory there. Found following the README as a new user."""

from __future__ import annotations

import torch
from torch import nn

import autobatch


def test_memory_held_beside_the_step_is_not_given_an_emptier_devices_answer(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                               lambda n: torch.randn(n, 32))
    probe = dict(cache=tmp_path, strategy="binary", steps_per_trial=1)
    with autobatch.simulated_memory("2MiB"):
        alone = autobatch.find_max_batch(step, **probe)
        assert autobatch.find_max_batch(step, **probe).cached  # nothing held beside it: a hit
        held = torch.empty(512 * 1024, dtype=torch.uint8)  # a quarter of the budget, kept beside the step
        fuller = autobatch.find_max_batch(step, **probe)
        assert not fuller.cached and fuller.batch_size < alone.batch_size
        assert any("more is allocated now than when its answer" in note for note in fuller.notes), fuller.notes
        assert fuller.batch_size == autobatch.find_max_batch(step, cache=False, strategy="binary", steps_per_trial=1).batch_size
        del held
        again = autobatch.find_max_batch(step, **probe)  # the entry still holds the step's own answer
    assert again.cached and again.batch_size == alone.batch_size
