"""A one-rank gloo group in the test's own process, with a ``"cpu"`` device mesh over it: what
``fully_shard`` needs to run FSDP2 on one rank without a launch; or the group alone. Import the
fixture into a test module (``from one_rank import one_rank_mesh``, ``one_rank_group``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_mesh():
    """The mesh of a one-rank group, torn down after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group, torn down after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
