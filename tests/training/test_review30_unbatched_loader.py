"""``DataLoader(dataset, batch_size=None)`` over a map-style dataset of single samples.

Automatic batching off, the loader yields the dataset's items one by one: the runner read a
sample's features (dim 0) as the batch, warned "a batch of 8 samples, not 16", and the model
failed on the sample. It is now one ``TypeError`` before anything trains, naming
``DataLoader(dataset, batch_size=N)``. Loading batched data stays legitimate: an
``IterableDataset`` yielding ready batches, and a map-style dataset whose items are whole batches.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autobatch import Runner
from runner_workloads import make_data, make_model, mse

GLOBAL = 16


class Samples(Dataset):
    """48 single samples: (features of 16, target of 1)."""

    def __init__(self) -> None:
        self.x, self.y = torch.randn(48, 16), torch.randn(48, 1)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class Batches(Dataset):
    """Three ready batches of 16, indexed by batch (PyTorch's "loading batched data")."""

    def __init__(self) -> None:
        self.batches = make_data(48, GLOBAL)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        return self.batches[index]


class Stream(IterableDataset):
    def __iter__(self):
        yield from make_data(48, GLOBAL)


def _runner() -> Runner:
    model = make_model()
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.05), mse, global_batch=GLOBAL, micro_batch=8,
                  progress=False, log_every=None)


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_unbatched_loader_of_single_samples_is_one_error_up_front(shuffle):
    runner = _runner()
    with pytest.raises(TypeError, match=rf"batch_size=None.*unbatched.*DataLoader\(dataset, batch_size={GLOBAL}\)"):
        runner.fit(DataLoader(Samples(), batch_size=None, shuffle=shuffle), steps=1)
    assert runner.step == 0


@pytest.mark.parametrize("loader", [lambda: DataLoader(Stream(), batch_size=None),
                                    lambda: DataLoader(Batches(), batch_size=None, shuffle=True)],
                         ids=["iterable-of-batches", "map-style-of-batches"])
def test_a_loader_of_ready_batches_without_batch_size_still_trains(loader):
    result = _runner().fit(loader(), epochs=1)
    assert result.steps == 3 and result.samples == 48


class SampleStream(IterableDataset):
    """A stream of single samples, (features of 16, target of 1), as a user's generator yields them."""

    def __iter__(self):
        yield from zip(*Samples().__dict__.values())


def test_review37_an_unbatched_stream_of_single_samples_names_batch_size():
    """A ``DataLoader(batch_size=None)`` of an ``IterableDataset`` yielding single samples cannot be
    read ahead, and failed at its first item with "batch tensors disagree on dim 0 ... batch[0] has
    16, batch[1] has 1", naming neither the loader nor ``batch_size``: the error now notes both."""
    runner = _runner()
    with pytest.raises(ValueError, match="disagree on dim 0") as caught:
        runner.fit(DataLoader(SampleStream(), batch_size=None), steps=1)
    assert any(f"DataLoader(dataset, batch_size={GLOBAL})" in note and "SampleStream" in note
               for note in caught.value.__notes__)
    assert runner.step == 0
