"""Review 14: the memory layer on cases a user met: a CUDA device with no index, a peer's quoted OOM.

* ``torch.cuda.get_per_process_memory_fraction`` and ``set_per_process_memory_fraction`` refuse a
  device without an index ("Expected a torch.device with a specified index"): a cap entered on
  ``torch.device("cuda")`` raised that ``ValueError`` before any trial.
* An error between ranks that quotes a peer's allocator message is not this rank's OOM."""

from __future__ import annotations

import torch

from autobatch.memory.devices import AcceleratorMemory


def test_a_cuda_device_without_an_index_is_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Card")
    memory = AcceleratorMemory(torch.device("cuda"))
    assert memory.device == torch.device("cuda", 1) and memory.name == "cuda:1 (Card)"
    assert AcceleratorMemory(torch.device("cuda", 0)).device == torch.device("cuda", 0)  # an index given is kept


def test_an_error_that_quotes_a_peers_oom_is_not_this_ranks_oom():
    """A ``PeerFailedError`` names the failed rank's error, whose words may be an allocator's (a
    ``RuntimeError`` that mentions "CUDA out of memory"); it read as an OOM of this rank, which
    then replayed the step while the failed rank had left it."""
    from autobatch import PeerFailedError, RankDisagreementError, is_oom_error

    quoted = "rank 1 raised an error at 'runner step 3' (RuntimeError: CUDA out of memory. Tried to allocate 2 MiB)"
    assert not is_oom_error(PeerFailedError(quoted, [1]))
    assert not is_oom_error(RankDisagreementError(0, "x", {1: "CUDA out of memory. Tried"}, "rank 1 left"))
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2 MiB"))  # a rank's own still is
