"""Review 27: under rank agreement a failed trial's clean-up makes a full garbage collection
(62-234 ms on the CPU host, ~0.12 s on an H200 host) only where the young generations left
memory held above the trial's starting level; where they did not, none."""

from __future__ import annotations

import gc

import pytest
import torch

from autobatch import simulated_memory
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.probe.trial import TrialRunner

from gc_recording import Cycle, collections

MiB = 2**20


@pytest.mark.parametrize("old, full", [(False, 0), (True, 1)])
def test_ranks_collect_fully_only_what_the_young_generations_left_held(monkeypatch, old, full):
    """A failing step leaves a 4 MiB tensor in a reference cycle, then runs out of memory. Young
    (made by the failing step): the quick collection frees it and no full one runs (it ran at every
    failure before). In the oldest generation (as a model built inside a plain callable and promoted
    by an automatic collection): the full collection still runs and frees it. Either way the
    clean-up leaves the memory at the trial's starting level."""
    def step(batch_size: int) -> None:
        holder = [Cycle(torch.empty(4 * MiB, dtype=torch.uint8))]
        if old:
            gc.collect()  # survives (held): promoted to the oldest generation
        holder.clear()  # garbage now, in a cycle
        torch.empty(batch_size * MiB, dtype=torch.uint8)  # out of memory at 13 (16 MiB budget)

    gc.collect()
    made = collections(monkeypatch)
    with simulated_memory("16MiB") as device:
        before = device.current_bytes
        runner = TrialRunner(step, SimulatedDeviceMemory(device), steps=1, agree=lambda record: record)
        assert not runner(13)
        assert device.current_bytes == before  # the failed step's memory is back
    assert made.count(2) == full and made.count(1) == 1, made
