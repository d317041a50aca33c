"""Review 14: ``device="cuda"`` (no index) measured and capped on the current CUDA device.

``torch.cuda.get_per_process_memory_fraction`` and ``set_per_process_memory_fraction`` refuse a
device without an index ("Expected a torch.device with a specified index"): a cap entered on
``torch.device("cuda")`` raised that ``ValueError`` before any trial."""

from __future__ import annotations

import torch

from autobatch.memory.devices import AcceleratorMemory


def test_a_cuda_device_without_an_index_is_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Card")
    memory = AcceleratorMemory(torch.device("cuda"))
    assert memory.device == torch.device("cuda", 1) and memory.name == "cuda:1 (Card)"
    assert AcceleratorMemory(torch.device("cuda", 0)).device == torch.device("cuda", 0)  # an index given is kept
