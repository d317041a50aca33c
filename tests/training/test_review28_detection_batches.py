"""Review 28: an object detector's batches (torchvision-style) through split, runner and probe.

``DataLoader(collate_fn=lambda b: tuple(zip(*b)))`` gives ``(images, targets)``: a tuple of
per-sample CHW images of their own sizes and a tuple of per-sample dicts with ``boxes`` [N_i, 4]
and ``labels`` [N_i] (N_i = 0 for some). A batch of 3 RGB images has every image's dim 0 equal
to its samples (3 channels), so the images read as the batch's *fields* and were cut along
their channels, while their targets, beside them, were cut as one entry per sample: a
detection run whose last batch held 3 samples failed inside the model's first conv
("expected input[1, 2, H, W] to have 3 channels, but got 2"), and a channel-agnostic model
trained other images than their targets without a word.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from autobatch import FaultInjector, Runner, split_batch
from autobatch.planning.samples import batch_size_of
from one_batch import assert_trains_as_one_batch


class TinyDetector(nn.Module):
    """``model(images, targets)`` -> dict of losses in train mode, as torchvision's detectors: a
    conv backbone over each image and a per-box head; each loss a mean over samples of the
    sample's mean over its boxes (0 for a sample with none), so one batch and its pieces agree."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3, padding=1)
        self.box_head = nn.Linear(4, 4)

    def forward(self, images, targets):
        losses = []
        for image, target in zip(images, targets):
            feature = self.backbone(image[None]).mean((2, 3))[0]
            boxes = target["boxes"]
            error = (self.box_head(feature).expand_as(boxes) - boxes).pow(2).sum(1)
            losses.append(error.mean() if boxes.shape[0] else feature.sum() * 0)
        return {"loss_box": torch.stack(losses).mean()}


def _sample(index: int):
    generator = torch.Generator().manual_seed(index)
    image = torch.randn(3, 6 + 2 * (index % 3), 5 + index % 4, generator=generator)  # sizes differ: never stacked
    count = index % 3  # 0, 1 or 2 boxes
    return image, {"boxes": torch.rand(count, 4, generator=generator), "labels": torch.zeros(count, dtype=torch.long),
                   "image_id": index}


def _collate(samples):
    return tuple(zip(*samples))


def _loss(model, batch):
    images, targets = batch
    return sum(model(list(images), list(targets)).values())


def test_three_rgb_images_are_split_as_samples_not_channels():
    batch = _collate([_sample(i) for i in range(3)])
    assert batch_size_of(batch) == 3
    pieces = split_batch(batch, 2)
    for piece in pieces:
        images, targets = piece
        assert len(images) == len(targets)
        for image, target in zip(images, targets):
            assert image.shape == _sample(target["image_id"])[0].shape  # whole, and its own target's image
    assert [t["image_id"] for piece in pieces for t in piece[1]] == [0, 1, 2]


def test_runner_trains_a_last_batch_of_three_once_with_one_batchs_gradient():
    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 11  # batches of 8 and 3

        def __getitem__(self, index):
            return _sample(index)

    trained: list[int] = []

    def loss_fn(model, batch):
        trained.extend(target["image_id"] for target in batch[1])
        return _loss(model, batch)

    torch.manual_seed(0)
    model = TinyDetector()
    reference = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(Samples(), batch_size=8, collate_fn=_collate)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Runner(model, optimizer, loss_fn, global_batch=8, micro_batch=2, log_every=0).fit(loader)
    assert sorted(trained) == list(range(11))  # no OOM injected: no replay, each sample once
    assert_trains_as_one_batch(model, reference, loader, _loss)


def test_oom_replay_of_a_zip_collated_batch_keeps_images_with_their_targets():
    trained: list[tuple[int, tuple[int, ...], int]] = []

    def loss_fn(model, batch):
        trained.extend((t["image_id"], tuple(image.shape), t["boxes"].shape[0]) for image, t in zip(*batch))
        return _loss(model, batch)

    torch.manual_seed(0)
    model = TinyDetector()
    batches = [_collate([_sample(i) for i in range(start, start + 3)]) for start in (0, 3)]
    faults = FaultInjector([(0, "backward")])
    result = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=3, micro_batch=3,
                    faults=faults, log_every=0).fit(batches)
    assert faults.fired == [(0, "backward")] and result.micro_batch < 3  # replayed in smaller pieces
    for index, shape, boxes in trained:
        image, target = _sample(index)
        assert shape == tuple(image.shape) and boxes == target["boxes"].shape[0]
    assert sorted({index for index, _, _ in trained}) == list(range(6))


def test_default_collated_list_of_fields_as_long_as_the_batch_stays_fields():
    """The tie-break above is for a zip collate's siblings alone: default_collate's list of
    fields (a sample's two crops, each stacked to [B, ...]) with B == 2 is still split as fields."""
    crops = [torch.arange(2 * 3).view(2, 3), torch.arange(2 * 3).view(2, 3) + 10]
    batch = {"x": torch.zeros(2, 5), "crops": crops, "name": ["a.png", "b.png"]}
    first, second = split_batch(batch, 1)
    assert [crop.tolist() for crop in first["crops"]] == [[[0, 1, 2]], [[10, 11, 12]]]
    assert second["name"] == ["b.png"]



def test_a_zip_collates_per_sample_numbers_are_split_with_their_images():
    """``tuple(zip(*batch))`` of ``(image, target, image_id)`` samples makes the ids a tuple of
    ints, which read as a constant (an image's ``(H, W)``) was given whole to every piece: the
    second piece's loss paired its images with the first piece's ids. Beside per-sample targets,
    in the zip's tuple, it is per sample; a dict's ``(H, W)`` beside per-sample dicts stays shared."""
    batch = _collate([(*_sample(i), 100 + i) for i in range(4)])
    pieces = split_batch(batch, 2)
    assert [piece[2] for piece in pieces] == [(100, 101), (102, 103)]
    assert [[t["image_id"] for t in piece[1]] for piece in pieces] == [[0, 1], [2, 3]]
    padded = {"targets": list(batch[1][:2]), "size": (32, 48)}
    assert [piece["size"] for piece in split_batch(padded, 1)] == [(32, 48), (32, 48)]
