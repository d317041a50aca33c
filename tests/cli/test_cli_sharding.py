"""The CLI's per-rank data, in one process: every rank's share is built here with an explicit
rank and world size under the same RNG state (what rank 0's epoch seed gives every rank under
torchrun), and the shares must be disjoint and add up to the one-process global batches."""

from __future__ import annotations

import pytest
import torch

from autobatch.workloads.batches import SyntheticBatches
from autobatch.cli.data import SyntheticEpochs
from autobatch.cli.ranks import hydra_overrides, launched_rank
from autobatch.cli.sharding import ShardedBatches, per_rank_batch, share_bounds, take_share


def epochs_of(data, count: int = 2) -> list[list]:
    """``count`` epochs of ``data``, drawn under seed 0 as the runner would (one iter per epoch)."""
    torch.manual_seed(0)
    return [list(data) for _ in range(count)]


@pytest.mark.parametrize("size", [1, 7, 8, 9, 16])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_blocks_cover_a_batch_once_in_order_and_differ_by_at_most_one(size, world):
    bounds = [share_bounds(size, rank, world) for rank in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_global_batch_that_does_not_split_is_a_config_error_naming_the_key():
    assert per_rank_batch(16, 2) == 8 and per_rank_batch(7, 1) == 7
    with pytest.raises(ValueError, match=r"train.global_batch=15 does not split evenly over 2 ranks .*train.global_batch=14 or 16"):
        per_rank_batch(15, 2)
    with pytest.raises(ValueError, match=r"train.global_batch=3 .* 4 ranks .*e.g. train.global_batch=4$"):
        per_rank_batch(3, 4)


def test_review31_a_resume_under_ranks_that_do_not_split_its_global_batch_names_the_ranks_that_do():
    """Resuming a global batch of 16 under 3 ranks advised "use a multiple of 3, e.g. the
    checkpoint's train.global_batch=15 or 18", which a resume cannot change (measured under
    torchrun --nproc-per-node 3): it names the numbers of ranks that split it."""
    key = "the checkpoint's train.global_batch (ck/last.pt)"
    with pytest.raises(ValueError, match=r"=16 does not split evenly over 3 ranks .*--nproc-per-node 2 or 4$") as error:
        per_rank_batch(16, 3, key=key, resumed=True)
    assert "multiple" not in str(error.value) and "=15" not in str(error.value)
    with pytest.raises(ValueError, match=r"--nproc-per-node 16$"):  # none above it
        per_rank_batch(16, 32, key=key, resumed=True)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_dataset_shares_are_disjoint_and_make_up_the_one_process_batches(shuffle, world):
    num_samples, global_batch = 50, 12  # 4 full batches and a last one of 2 (< 3 ranks: dropped for 3)
    alone = epochs_of(ShardedBatches(num_samples, global_batch, shuffle=shuffle, rank=0, world=1))
    shares = [epochs_of(ShardedBatches(num_samples, global_batch, shuffle=shuffle, rank=r, world=world)) for r in range(world)]
    for epoch, batches in enumerate(alone):
        kept = batches if world == 2 else batches[:-1]
        assert all(len(share[epoch]) == len(kept) for share in shares)
        for step, batch in enumerate(kept):
            assert sum((share[epoch][step] for share in shares), []) == batch  # rank 0's block first
        trained = sorted(i for share in shares for batch in share[epoch] for i in batch)
        assert trained == sorted(sum(kept, [])) and len(set(trained)) == len(trained)
    assert sorted(sum(alone[0], [])) == list(range(num_samples))
    assert (alone[0] != alone[1]) == shuffle  # a new permutation each epoch, only when shuffling
    assert len(ShardedBatches(num_samples, global_batch, shuffle=shuffle, rank=0, world=world)) == (5 if world == 2 else 4)


def test_the_permutation_depends_on_the_rng_state_when_the_epoch_starts():
    sampler = ShardedBatches(20, 4, shuffle=True, rank=1, world=2)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    first = iter(sampler)  # the seed is drawn here, not at the first next()
    torch.rand(5)
    torch.set_rng_state(state)
    assert list(first) == list(iter(sampler))


def test_synthetic_shares_make_up_the_one_process_batches():
    make = SyntheticBatches(inputs="tensor", shape=(3,), num_classes=4)
    alone = epochs_of(SyntheticEpochs(make, 8, 3))
    shares = [epochs_of(SyntheticEpochs(make, 8, 3, rank=r, world=2)) for r in range(2)]
    for epoch, batches in enumerate(alone):
        for step, (inputs, targets) in enumerate(batches):
            parts = [share[epoch][step] for share in shares]
            assert all(part[0].shape[0] == 4 for part in parts)
            assert torch.equal(torch.cat([part[0] for part in parts]), inputs)
            assert torch.equal(torch.cat([part[1] for part in parts]), targets)
    assert not torch.equal(alone[0][0][0], alone[1][0][0])


def test_take_share_copies_its_block_and_keeps_one_process_batches_as_they_are():
    batch = {"x": torch.arange(10).reshape(5, 2), "y": torch.arange(5)}
    assert take_share(batch, 0, 1) is batch
    share = take_share(batch, 1, 2)  # 5 over 2 ranks: 3 and 2
    assert share["y"].tolist() == [3, 4] and share["x"].tolist() == [[6, 7], [8, 9]]
    assert share["x"].untyped_storage().nbytes() == 4 * 8  # not a view of the whole batch
    # per-sample lists are this rank's too (every rank kept all the names), a 0-dim tensor is shared
    named = take_share({"x": torch.arange(5), "name": [f"img{i}" for i in range(5)], "scale": torch.tensor(2.0)}, 1, 2)
    assert named["name"] == ["img3", "img4"] and named["x"].tolist() == [3, 4] and named["scale"].item() == 2.0


def test_ranks_other_than_zero_keep_hydra_out_of_the_run_directory(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert launched_rank() == 0 and hydra_overrides([]) == []
    monkeypatch.setenv("RANK", "1")
    assert launched_rank() == 1
    assert hydra_overrides(["model=mlp"]) == ["hydra.output_subdir=null", "hydra/job_logging=rank"]
    assert hydra_overrides(["hydra/job_logging=disabled"]) == ["hydra.output_subdir=null"]  # the user's choice stays
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched_rank() == 0 and hydra_overrides([]) == []
