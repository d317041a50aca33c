"""Review 35: what a plain callable ``fn(batch_size)`` really does, on the CPU's simulated device.

An out-of-memory error the callable catches itself fails its trial; a data source that runs dry
(``StopIteration``) or a Python ``MemoryError`` is not out of memory and gets a note naming the
batch and what to change; a callable object's and a bound method's settings are in the cache key.
"""

import functools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autobatch import find_max_batch, simulated_memory
from autobatch.probe.caching.cache_key import callable_components


def test_review35_a_step_that_catches_its_own_oom_does_not_pass():
    """Before: every trial passed and the probe climbed to its search ceiling (16777216)."""
    def guarded(batch_size: int) -> bool:  # a user's retry wrapper around the step
        try:
            torch.empty(batch_size, 1024)
            return True
        except torch.OutOfMemoryError:
            return False

    with simulated_memory("4MiB"):
        result = find_max_batch(guarded, strategy="binary", steps_per_trial=1)
    assert result.batch_size == 1024 and result.smallest_failed == 1025  # 4 KiB a sample, 4 MiB
    failed = [r for r in result.trials if not r.passed]
    assert failed and all("guarded returned at batch" in r.error for r in failed)
    assert any("caught inside the step" not in n and "is_oom_error(exc): raise" in n for n in result.notes)


@pytest.mark.parametrize("form", ["dataloader", "generator", "memory"])
def test_review35_data_that_runs_dry_or_a_host_memory_error_is_no_oom(form):
    """A dataset of 50 samples: a StopIteration past it (or PEP 479's RuntimeError of one raised in a
    generator) and a user's MemoryError propagate with a note naming the batch and what to change;
    before, the note sent them to multiple_of (a step that refuses odd sizes)."""
    dataset = TensorDataset(torch.randn(50, 4))

    def batches(batch_size):
        if batch_size > 50:
            raise StopIteration
        yield torch.zeros(batch_size)

    def step(batch_size: int):
        if form == "dataloader":
            return next(iter(DataLoader(dataset, batch_size=batch_size, drop_last=True)))[0].sum()
        if form == "generator":
            return list(batches(batch_size))
        if batch_size > 50:
            raise MemoryError("my cache is full")
        return torch.zeros(batch_size)

    raised = {"dataloader": StopIteration, "generator": RuntimeError, "memory": MemoryError}[form]
    with simulated_memory("4MiB"), pytest.raises(raised) as info:
        find_max_batch(step, strategy="binary", steps_per_trial=1)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "probe trial at batch 64, after trials at 1, 2, 4, ..., 32 passed" in note, note
    assert "multiple_of" not in note
    assert ("not the device allocator's" in note) if form == "memory" else ("max_batch=len(dataset)" in note)


def test_review35_an_objects_settings_are_in_a_plain_callables_cache_key():
    """Before: ``Step(512)`` and ``Step(128)`` (a callable object, or a bound method) had one key
    under one cache_key, so the longer sequence was served the shorter one's answer."""
    class Step:
        def __init__(self, seq_len):
            self.seq_len, self.calls = seq_len, 0

        def __call__(self, batch_size):
            self.calls += 1  # a counter: not keyed, or every call would miss
            return torch.zeros(batch_size, self.seq_len)

        def run(self, batch_size):
            return torch.zeros(batch_size, self.seq_len)

    for make in (lambda n: Step(n), lambda n: Step(n).run, lambda n: functools.partial(Step(n).run)):
        short, long = callable_components(make(128), None), callable_components(make(512), None)
        assert short != long and short == callable_components(make(128), None)
    step = Step(128)
    before = callable_components(step, None)
    step(1)
    assert callable_components(step, None) == before
