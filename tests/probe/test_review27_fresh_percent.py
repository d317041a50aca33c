"""The check in a new process's layout stops within a percent, as the bisection of the trials'
own layout does (issue 16: a convolutional VAE's plain callable on an H200 spent ten trials,
3.4 s, walking 1528 down to 1437 a unit at a time where a percent is 14 units)."""

import torch

from autobatch import simulated_memory
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.probe.fresh_layout import in_fresh_layout
from autobatch.probe.searching.search import _confirm
from autobatch.probe.trial import TrialRunner

MiB = 2**20


def _fresh_search(answer: int, boundary: int):
    """The check in a new process's layout from ``answer`` (passed in the trials' own layout),
    where every size above ``boundary`` fails with no bytes over measured: what it found, and
    its trials."""
    layout = {"now": None}

    def step(batch_size: int) -> None:
        held = torch.empty(batch_size * 10_000, dtype=torch.uint8)  # noqa: F841 - the step's activations
        if layout["now"] == "fresh" and batch_size > boundary:  # no bytes over measured: bisection
            raise torch.OutOfMemoryError("CUDA out of memory.")

    with simulated_memory("64MiB") as device:
        memory = SimulatedDeviceMemory(device)
        runner = TrialRunner(step, memory, steps=2, peak_limit=60 * MiB, settle_final=True, hand_loop=True,
                             layout=lambda: layout.update(now="resumed"))
        assert runner.run(answer, "confirm", settle=True).passed
        found = in_fresh_layout(runner, answer, 1, lambda: layout.update(now="fresh"),
                                lambda units: _confirm(runner, units, 1, after_last_oom=True))
    return found, [r for r in runner.records if r.purpose == "fresh"]


def test_the_fresh_layout_search_ends_within_a_percent_of_its_boundary():
    found, fresh = _fresh_search(1580, 1536)
    assert 0.99 * 1536 <= found <= 1536
    assert all(r.passed == (r.batch_size <= 1536) for r in fresh)
    assert len(fresh) <= 5, [(r.batch_size, r.passed) for r in fresh]  # a unit's width took 8


def test_small_sizes_still_end_at_one_unit():
    found, _ = _fresh_search(59, 51)
    assert found == 51
