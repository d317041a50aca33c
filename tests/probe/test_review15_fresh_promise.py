"""The promise describes the answer's own confirmation, not the new-process check after it."""

import torch

from autobatch import simulated_memory
from autobatch.probe.promise import promise_of
from autobatch.probe.result import ProbeResult
from autobatch.probe.trial import TrialRunner

MiB = 2**20


def test_the_promise_reads_the_answers_confirmation_not_the_fresh_layouts_trial_after_it():
    """With cuDNN autotuning the answer's confirmation autotunes and the fresh layout's check after
    it (a step whose largest request is a tenth of the capacity) runs untuned: the promise read the
    later trial and said the answer was not autotuned (tests/gpu/test_cuda_promise.py on an H200)."""
    with simulated_memory("64MiB") as device:
        from autobatch.memory.devices import SimulatedDeviceMemory

        memory = SimulatedDeviceMemory(device)
        runner = TrialRunner(lambda n: torch.empty(n * 1000, dtype=torch.uint8), memory, steps=3,
                             peak_limit=60 * MiB, settle_final=True)
        confirm = runner.run(42, "confirm", settle=True)
        fresh = runner.run(42, "fresh", settle=True)
    confirm.autotuned, fresh.autotuned = True, False
    result = ProbeResult(batch_size=42, strategy="auto", strategy_used="predict", trials=runner.records,
                         capacity_bytes=64 * MiB, elapsed_s=0.0, margin=0.0)
    assert promise_of(runner, result, memory)["autotuned"] is True
