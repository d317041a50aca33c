"""The fresh-layout check's search ends where even one unit fails in that layout with its bytes
over measured: it aimed at 1 below a failed 1 and ran that trial again for ever."""

import pytest
import torch

from autobatch import simulated_memory
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.probe.fresh_layout import in_fresh_layout
from autobatch.probe.searching.search import _confirm
from autobatch.probe.trial import TrialRunner

MiB = 2**20


def test_a_fresh_layout_that_fails_at_every_size_ends_with_no_answer():
    layout, calls = {"now": None}, {"n": 0}
    with simulated_memory("64MiB") as device:
        memory = SimulatedDeviceMemory(device)

        def step(batch_size: int) -> None:
            calls["n"] += 1
            assert calls["n"] < 100, "the search did not end"
            held = torch.empty(batch_size * 1_000_000, dtype=torch.uint8)
            if layout["now"] == "fresh":  # 5 MB over at every size, measured from the failed request
                wanted = 60 * MiB + 5_000_000 - memory.allocated()
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {wanted / MiB:.2f} MiB")
            del held

        runner = TrialRunner(step, memory, steps=3, peak_limit=60 * MiB, settle_final=True, hand_loop=True,
                             layout=lambda: layout.update(now="resumed"))
        assert runner.run(3, "confirm", settle=True).passed
        found = in_fresh_layout(runner, 3, 1, lambda: layout.update(now="fresh"),
                                lambda units: _confirm(runner, units, 1, after_last_oom=True))
    assert found is None
    assert [(r.batch_size, r.passed) for r in runner.records if r.purpose == "fresh"] == [(3, False), (1, False)]


def test_whether_the_fresh_layout_is_checked_is_agreed_between_ranks():
    """Each rank measures its own largest segment; a rank under the line must still run the check
    where another rank's step is over it, or their per-trial agreement disagrees."""
    from autobatch.probe.fresh_layout import FreshLayout

    class Segments:
        def __init__(self, largest):
            self.largest = largest

        def largest_segment(self):
            return self.largest

    asked = []
    small = FreshLayout(lambda: None, Segments(2), agree=lambda mine: asked.append(mine) or True)
    assert small.needed(100) is True and asked == [False]  # another rank's is a tenth or more
    assert FreshLayout(lambda: None, Segments(2)).needed(100) is False  # one process: its own
    assert FreshLayout(lambda: None, Segments(10)).needed(100) is True


def test_no_size_passing_the_fresh_layout_says_so_and_what_to_do():
    """Sizes passed in the probe's own layout, none beside state made in its first step: the error
    said only that batch 1 ran out of memory."""
    from autobatch import simulated_memory
    from autobatch.errors import NoBatchFitsError
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.fresh_layout import FreshLayout
    from autobatch.probe.searching.search import run_search
    from autobatch.probe.trial import TrialRunner

    mib, layout = 2**20, {"now": None}

    class Segmented(SimulatedDeviceMemory):
        def largest_segment(self):
            return 16 * mib

    with simulated_memory("64MiB") as device:
        memory = Segmented(device)

        def step(n):
            held = torch.empty(n * 1_000_000, dtype=torch.uint8)  # noqa: F841 - held at the failure
            if n > 3 or layout["now"] == "fresh":
                wanted = 60 * mib + 5_000_000 - memory.allocated()
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {wanted / mib:.2f} MiB")

        runner = TrialRunner(step, memory, steps=3, peak_limit=60 * mib, settle_final=True, hand_loop=True,
                             layout=lambda: layout.update(now="resumed"))
        with pytest.raises(NoBatchFitsError, match="3 passed in the probe's own layout.*expandable"):
            run_search(runner, strategy="binary", start=None, max_batch=64, margin=0.0, multiple_of=1, device_name="sim",
                       capacity=64 * mib, confirm=True, hand_loop=True,
                       fresh_layout=FreshLayout(lambda: layout.update(now="fresh"), memory))
