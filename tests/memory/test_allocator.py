"""The caching allocator's expandable-segments setting: read from torch and the environment, set."""

from __future__ import annotations

import pytest
import torch

from autobatch.memory import allocator


@pytest.fixture
def settings(monkeypatch):
    """The allocator's settings as they were, restored after the test (torch keeps the last
    string it was given; this module keeps what it set)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    before = getter() if getter is not None else None
    for var in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(allocator, "_set_here", None)
    yield
    if before is not None:
        torch._C._accelerator_setAllocatorSettings(before)


def test_the_environment_names_the_setting_or_not(settings, monkeypatch):
    assert allocator.environment_expandable_segments() is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments : True")
    assert allocator.environment_expandable_segments() is True
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # the newer name, read last
    assert allocator.environment_expandable_segments() is False
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert allocator.environment_expandable_segments() is True


def test_what_was_set_at_run_time_wins_over_the_environment(settings, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    allocator.set_expandable_segments(False)
    assert allocator.expandable_segments() is False
    allocator.set_expandable_segments(True)
    assert allocator.expandable_segments() is True


def test_a_torch_that_cannot_report_its_settings_is_read_from_what_was_set(settings, monkeypatch):
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    assert allocator.expandable_segments() is False
    allocator.set_expandable_segments(True)
    assert allocator.expandable_segments() is True
