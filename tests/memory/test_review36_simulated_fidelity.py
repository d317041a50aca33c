"""Review 36: the simulated device counts what a device would for two programs it got wrong.

* An operator that grows a tensor made before the block in place (``Tensor.resize_``, an ``out=``
  tensor too small for the result) allocated on a device, but the simulation counted 0 bytes
  (``pre.resize_(1000)`` of a 10-float tensor: 0 where ``UntypedStorage.resize_`` counts 3960).
* Nested blocks: an allocation the inner budget refused raised the outer block's ``peak_bytes``
  (by 4000 for a refused 1000-float tensor), though it never existed.
"""

from __future__ import annotations

import pytest
import torch

from autobatch.memory.simulated import simulated_memory


def test_review36_an_operator_growing_a_tensor_made_before_the_block_counts_the_growth():
    before = torch.zeros(10)  # 40 bytes, not counted
    a, b = torch.ones(1000), torch.ones(1000)
    target = torch.empty(0)
    with simulated_memory("1MiB") as device:
        before.resize_(1000)
        assert device.current_bytes == 3960  # before: 0
        torch.add(a, b, out=target)  # resized to 4000 bytes by the operator
        assert device.current_bytes == 7960
        with pytest.raises(torch.OutOfMemoryError, match="simulated device"):
            torch.empty(0).resize_(2**20)  # 4 MiB past the budget: still refused
        del before
        assert device.current_bytes == 4000  # released when it dies
        del target
        assert device.current_bytes == 0 and device.peak_bytes == 7960


def test_review36_an_allocation_an_inner_budget_refuses_leaves_the_outer_peak_alone():
    with simulated_memory("1MiB") as outer:
        kept = torch.zeros(100)
        with simulated_memory(3000) as inner:
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(1000)
            assert inner.peak_bytes == 0
        assert outer.peak_bytes == 400 and outer.current_bytes == 400  # before: 4400
        with simulated_memory(3000):
            with pytest.raises(torch.OutOfMemoryError):
                torch.zeros(1000)
            torch.zeros(500)  # fits both: raises both peaks
        assert outer.peak_bytes == 2400 and kept.numel() == 100
