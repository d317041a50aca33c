"""``UntypedStorage.resize_`` under the simulated device.

``resize_`` is no ATen operator on the CPU, so the simulation's dispatch mode never saw it: under
``simulated_memory("1MiB")`` a storage resized to 4 MB counted 0 bytes, and one resized to 0 gave
nothing back. FSDP2 (``fully_shard``) allocates and frees its unsharded parameters exactly that
way, so a second probe of an FSDP2 model answered higher than a fresh model trains (see
``tests/distributed/test_review24b_fsdp_resize.py``). Now growth counts (and runs out of memory
before the bytes change), shrinking gives back, to 0 and again.
"""

from __future__ import annotations

import pytest
import torch

from autobatch.memory.simulated import host_memory, simulated_memory


def test_a_storage_resize_counts_growth_and_gives_back_on_shrinking():
    before = torch.ones(1000)  # made before the simulation: its 4000 bytes are not counted
    with simulated_memory("1MiB") as device:
        made = torch.empty(0)
        made.untyped_storage().resize_(400_000)
        assert device.current_bytes == 400_000  # before: 0
        made.untyped_storage().resize_(0)
        assert device.current_bytes == 0
        made.untyped_storage().resize_(200_000)  # and back
        assert device.current_bytes == 200_000 and device.peak_bytes == 400_000
        with pytest.raises(torch.OutOfMemoryError, match=r"UntypedStorage\.resize_.*simulated device"):
            made.untyped_storage().resize_(4_000_000)
        assert made.untyped_storage().nbytes() == 200_000  # a failed allocation changes nothing
        before.untyped_storage().resize_(0)  # frees bytes the budget never counted: gives none back
        assert device.current_bytes == 200_000
        before.untyped_storage().resize_(8000)  # grown inside: counted, from 0
        assert device.current_bytes == 208_000
        del before
        assert device.current_bytes == 200_000  # released when it dies
        with host_memory():
            host = torch.empty(0)
            host.untyped_storage().resize_(100_000)  # host memory: no budget counts it
        assert device.current_bytes == 200_000
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # torch's own again after the block
