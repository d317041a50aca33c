"""``simulated_memory(memory_limit="16MiB")``, the name every other entry point gives the budget,
was Python's bare "unexpected keyword argument"; it is taken as ``limit``, as
``estimate_max_batch(memory_limit=)`` is taken as ``capacity``."""

from __future__ import annotations

import pytest
import torch

import autobatch


def test_memory_limit_is_the_budget():
    with autobatch.simulated_memory(memory_limit="1MiB") as device:
        assert device.limit_bytes == 1 << 20
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(1 << 19)  # 2 MiB of float32, over the 1 MiB budget


def test_both_names_at_once_is_one_error():
    with pytest.raises(TypeError, match="got both limit and memory_limit, two names of one argument"):
        autobatch.simulated_memory("1MiB", memory_limit="2MiB")
