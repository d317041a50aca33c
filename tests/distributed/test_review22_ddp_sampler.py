"""Two CPU ranks (gloo), through DDP: a ``DistributedSampler(drop_last=False)`` loader whose last
batch is short on every rank (39 samples padded to 40, 8 per rank per step, then 4) trains as one
process does on the same global batches: the short step's mean is over its 8 samples, not the
configured 16 (``autobatch.dist.ddp_step`` re-weights DDP's buckets by the shares' sum), and each
epoch draws the sampler's own order (the runner calls ``set_epoch``). One scenario of the shared
``plain`` launch of ``tests/distributed_worker.py`` (no launch of its own).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from autobatch import Runner
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights
from test_distributed import PLAIN, shared

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _global_batches(epochs: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per epoch, the global batches the two ranks' loaders make together (rank 0's share, then rank 1's)."""
    x, y, _ = make_data(39, 39)[0]
    dataset = TensorDataset(x, y)
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3) for rank in range(2)]
    runs = []
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        shares = [list(sampler) for sampler in samplers]
        steps = [shares[0][i : i + 8] + shares[1][i : i + 8] for i in range(0, len(shares[0]), 8)]
        runs.append([(x[index], y[index]) for index in map(torch.tensor, steps)])
    return runs


class _Epochs:
    """Each epoch's own global batches, one list per pass (as the ranks' loaders draw them)."""

    def __init__(self, runs: list[list]) -> None:
        self.runs, self.passes = runs, 0

    def __len__(self) -> int:
        return len(self.runs[0])

    def __iter__(self):
        self.passes += 1
        return iter(self.runs[self.passes - 1])


def test_a_short_last_batch_from_a_distributed_sampler_trains_as_one_process(tmp_path_factory):
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["ddp_sampler"]
    model = make_model(width=16)
    runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), mse, global_batch=16, micro_batch=8,
                    grow_after=None, progress=False, log_every=None)
    epochs = _global_batches(2)
    assert [len(batch[0]) for batch in epochs[0]] == [16, 16, 8]  # the short step the test is about
    result = runner.fit(_Epochs(epochs), epochs=2)
    for report in reports:
        assert report["steps"] == 6 and report["samples"] == 80
        assert report["loss"] == pytest.approx(float(result.last_loss), rel=1e-9)
        assert_weights_close([torch.tensor(w, dtype=torch.float64) for w in report["weights"]], weights(model))


def test_review37_a_rank_given_the_whole_global_batch_is_told_the_share(caplog):
    """``DataLoader(dataset, batch_size=global_batch, sampler=DistributedSampler(dataset))`` on 2 ranks
    gave each rank the whole global batch: every step trained twice the samples asked for, and the one
    warning ("a batch of 8 samples, not 4") hinted only at sequence-first inputs. It now says that
    ``global_batch`` is global, what the steps train, and the loader to pass (the warning itself,
    as the runner calls it on rank 0 of 2)."""
    from autobatch.training.inputs import warn_batch_size

    with caplog.at_level("WARNING", logger="autobatch"):
        warn_batch_size(8, 4, 1, "rank 0: ", 2)
        warn_batch_size(6, 4, 1, "rank 0: ", 2)  # a larger batch but not the global one: the dim-0 hint as before
    first, other = (record.getMessage() for record in caplog.records)
    assert "global_batch=8 is global, over 2 ranks, and these steps train 16 samples" in first
    assert "DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset))" in first
    assert "sequence-first" not in first and "sequence-first" in other and "is global" not in other
