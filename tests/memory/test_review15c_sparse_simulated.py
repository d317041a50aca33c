"""The simulated device with tensors that have no storage of their own: sparse compressed tensors
crashed every operator that made one ("Cannot access storage of SparseCsrTensorImpl"), COO tensors
were not counted at all, and MKL-DNN tensors crashed too."""

import pytest
import torch

from autobatch import simulated_memory
from autobatch.memory.simulated import to_simulated_device


@pytest.mark.parametrize("make", [
    lambda x: x.to_sparse_csr(),
    lambda x: x.to_sparse_csc(),
    lambda x: x.to_sparse_bsr((8, 8)),
    lambda x: x.to_sparse(),
])
def test_sparse_tensors_are_counted_by_their_parts_and_given_back(make):
    dense = torch.randn(64, 64)
    with simulated_memory("16MiB") as device:
        sparse = make(dense)
        held = device.current_bytes
        parts = sparse.values().nbytes if sparse.layout != torch.sparse_coo else sparse._values().nbytes
        assert held >= parts > 0  # the values at least (plus the indices)
        assert to_simulated_device(sparse) is sparse  # already device memory: not copied again
        del sparse
        assert device.current_bytes == 0


def test_sparse_ops_past_the_budget_raise_the_simulated_oom():
    dense = torch.randn(512, 512)  # 1 MiB dense; its COO form holds 5 MiB of indices and values
    with simulated_memory("2MiB"), pytest.raises(torch.OutOfMemoryError, match="Simulated out of memory"):
        dense.to_sparse()


def test_opaque_mkldnn_tensors_do_not_crash_the_simulation():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no MKL-DNN in this torch build")
    with simulated_memory("16MiB"):
        out = torch.relu(torch.randn(32, 32).to_mkldnn()).to_dense()
    assert out.shape == (32, 32)


def test_a_sparse_tensor_made_in_the_block_is_device_memory():
    from autobatch.memory.devices import simulated_counts

    host = torch.randn(8, 8).to_sparse_csr()
    with simulated_memory("1MiB"):
        assert simulated_counts(torch.randn(8, 8).to_sparse_csr())
        assert not simulated_counts(host)
