"""A resume inside an epoch on data of another size: the user appended samples, or filtered some
out, between the interrupted run and its resume. The resume skips the epoch's first batches as the
trained ones, and in data of another size those are other samples (a shuffle of another length,
indices shifted past a filtered sample): a shuffled 22-sample set grown to 26 trained 3 samples
twice and 3 not at all, filtered to 18 it trained 4 twice and 6 not at all, without a word. Now one
``ValueError`` naming both sizes and how to go on; a new epoch on new data is no such case. And an
``IterableDataset`` that yields nothing was a bare ``TypeError: ... has no len()``."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autobatch import Runner

N, GLOBAL = 22, 4


class Items(Dataset):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return torch.full((3,), index * 0.01, dtype=torch.float64), index


class Stream(IterableDataset):
    """A stream with a length (an ``IterableDataset`` defining ``__len__``)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self):
        return (Items(self.n)[i] for i in range(self.n))

    def __len__(self) -> int:
        return self.n


def shuffled(n: int = N) -> DataLoader:
    return DataLoader(Items(n), batch_size=GLOBAL, shuffle=True, generator=torch.Generator().manual_seed(5))


def streamed(n: int = N) -> DataLoader:
    return DataLoader(Stream(n), batch_size=GLOBAL)


def _runner(checkpoint_dir=None, global_batch=GLOBAL):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    trained: list[int] = []

    def loss_fn(model, batch):
        trained.extend(batch[1].tolist())  # no OOM here: every call is an applied one
        return model(batch[0]).pow(2).mean()

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=global_batch,
                    micro_batch=global_batch, device="cpu", progress=False, log_every=None, checkpoint_dir=checkpoint_dir)
    return runner, trained


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("make", "size"), [(shuffled, 26), (shuffled, 18), (shuffled, 23), (streamed, 18)],
                         ids=["appended", "filtered", "one-more", "stream-filtered"])
def test_a_mid_epoch_resume_on_resized_data_is_one_error(tmp_path, make, size):
    runner, _ = _runner(tmp_path)
    runner.fit(make(), steps=3)  # 12 of the epoch's 22 samples
    saved = (tmp_path / "last.pt").read_bytes()
    runner, trained = _runner(tmp_path)
    with pytest.raises(ValueError, match=rf"stopped 3 batches into epoch 1 of data holding {N} samples; this data holds "
                                         rf"{size}: samples were added or removed.*some would train twice, others not at "
                                         r"all\. Finish epoch 1 on the data it was trained on \(fit\(data, epochs=1"):
        runner.fit(make(size), epochs=2, resume=tmp_path)
    assert trained == [] and (tmp_path / "last.pt").read_bytes() == saved  # nothing trained, nothing overwritten


@pytest.mark.filterwarnings("ignore")
def test_the_advised_way_trains_each_epoch_on_its_data_once(tmp_path):
    runner, first = _runner(tmp_path)
    runner.fit(shuffled(), steps=3)
    runner, rest = _runner(tmp_path)
    runner.fit(shuffled(), epochs=1, resume=tmp_path)  # the epoch finished on its data
    assert collections.Counter(first + rest) == {i: 1 for i in range(N)}
    runner, grown = _runner(tmp_path)
    runner.fit(shuffled(26), epochs=2, resume=tmp_path)  # the next epoch, from its start, on the new data
    assert sorted(grown) == list(range(26))


@pytest.mark.filterwarnings("ignore")
def test_a_second_fit_inside_an_epoch_on_resized_data_is_refused_too():
    runner, _ = _runner()
    runner.fit(shuffled(), steps=2)
    with pytest.raises(ValueError, match=rf"data holding {N} samples; this data holds 24"):
        runner.fit(shuffled(24), epochs=1)


@pytest.mark.filterwarnings("ignore")
def test_another_global_batch_over_the_same_samples_is_no_resize(tmp_path):
    """A loader rebuilt for another ``global_batch`` has other batches, as many samples: resumed."""
    runner, first = _runner(tmp_path)
    runner.fit(shuffled(), steps=2)  # 8 samples
    runner, rest = _runner(tmp_path, global_batch=2)
    runner.fit(DataLoader(Items(), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5)), epochs=1,
               resume=tmp_path)
    assert sorted(first + rest) == list(range(N))


def test_an_iterable_dataset_that_yields_nothing_is_named_empty():
    class Empty(IterableDataset):
        def __iter__(self):
            return iter([])

    runner, _ = _runner()
    with pytest.raises(ValueError, match=r"data yielded no batches in epoch 1: it is empty .*IterableDataset that yields "
                                         r"no samples\); pass data"):
        runner.fit(DataLoader(Empty(), batch_size=GLOBAL), epochs=1)
