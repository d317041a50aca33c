"""``fit(data)`` given something that is not yet an iterable of batches: a generator function not
called, a map-style ``Dataset`` without its ``DataLoader``. Both were refused with advice to
"pass [batch]" (which trains one batch, not the data set); the error names the fix instead."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner


def _runner() -> Runner:
    model = torch.nn.Linear(2, 1)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, batch: m(batch).mean(), global_batch=2,
                  micro_batch=2, device="cpu", progress=False)


def test_a_generator_function_not_called_names_the_call():
    def batches():
        yield torch.ones(2, 2)

    with pytest.raises(TypeError, match=r"got the generator function .*batches itself; call it: fit\(.*batches\(\)\)") as info:
        _runner().fit(batches)
    assert "[batch]" not in str(info.value)


def test_a_map_style_dataset_names_the_data_loader():
    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.ones(2)

    with pytest.raises(TypeError, match=r"got the Dataset Samples, whose items are single samples; batch it: "
                                         r"fit\(DataLoader\(dataset, batch_size=global_batch\)\)$"):
        _runner().fit(Samples())
