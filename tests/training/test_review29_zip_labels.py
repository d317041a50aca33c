"""Review 29: the runner on ``DataLoader(collate_fn=lambda b: tuple(zip(*b)))`` of ``(RGB image,
int label)`` samples. The first step's batch of 8 was "cannot tell the batch's size: it fits 3
or 8 samples"; a last batch of 3 was cut along the images' channels, every piece given all 3
labels. Now each sample trains once with its own label, as one batch's step would."""

from __future__ import annotations

import copy

import torch
from torch import nn

from autobatch import Runner
from one_batch import assert_trains_as_one_batch


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 11  # batches of 8 and 3

    def __getitem__(self, index: int):
        return torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(index)), index % 2


def _collate(samples):
    return tuple(zip(*samples))


def _loss(model, batch):
    images, labels = batch
    return nn.functional.cross_entropy(model(torch.stack(images)), torch.tensor(labels))


def test_runner_trains_zip_collated_images_with_their_int_labels_as_one_batch():
    seen: list[tuple[float, int]] = []

    def loss_fn(model, batch):
        seen.extend((float(image[0, 0, 0]), label) for image, label in zip(*batch))
        return _loss(model, batch)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(Samples(), batch_size=8, collate_fn=_collate)
    Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=8, micro_batch=2,
           log_every=0).fit(loader)
    assert sorted(seen) == sorted((float(image[0, 0, 0]), label) for image, label in map(Samples().__getitem__, range(11)))
    assert_trains_as_one_batch(model, reference, loader, _loss)
