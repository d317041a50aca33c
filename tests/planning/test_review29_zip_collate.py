"""Review 29: a ``collate_fn=lambda b: tuple(zip(*b))`` batch of ``(image, label)`` samples.

It is ``(B image tensors [C, H, W], B python ints)``. Every image's dim 0 is its channels, so
the images also read as the batch's *fields* (C samples) while the ints read as a constant
tuple: ``batch_size_of`` said "cannot tell the batch's size: it fits 3 or 4 samples", and a
batch of 3 RGB images was cut along its channels with every piece given all 3 labels, silently.
The same for labels as 0-dim tensors, captions (a tuple of strings), token lists, lists instead
of tuples, and a named tuple built from the zip.
"""

from __future__ import annotations

import collections

import pytest
import torch

from autobatch import split_batch
from autobatch.planning.samples import batch_size_of, cycle_samples


def _image(i: int) -> torch.Tensor:
    return torch.full((3, 5, 4), float(i))


def _check(pieces, size, labels, at=1):
    """Each piece's images (part 0) are the samples its labels (part ``at``) belong to."""
    assert [len(piece[at]) for piece in pieces] == [2, size - 2]
    for start, piece in zip((0, 2), pieces):
        assert [image.shape for image in piece[0]] == [torch.Size([3, 5, 4])] * len(piece[at])
        assert [int(image[0, 0, 0]) for image in piece[0]] == list(range(start, start + len(piece[at])))
        assert list(piece[at]) == labels[start:start + len(piece[at])]


def test_zip_collate_of_images_and_labels_or_captions_splits_by_sample():
    for kind in (tuple, list):
        for size in (3, 4):  # 3: the images' channels, which read as the batch's size before
            for label in (int, torch.tensor, lambda i: f"a photo of {i}", lambda i: [7] * (i + 1)):
                labels = [label(i) for i in range(size)]
                batch = kind(kind(part) for part in zip(*[(_image(i), labels[i]) for i in range(size)]))
                assert batch_size_of(batch) == size
                pieces = split_batch(batch, 2)
                assert all(type(piece) is kind and {type(part) for part in piece} == {kind} for piece in pieces)
                _check(pieces, size, labels)
                assert list(cycle_samples(batch, size + 1, size)[1]) == labels + labels[:1]


def test_a_named_tuple_of_a_zip_and_a_dict_of_images_and_captions_split_by_sample():
    Batch = collections.namedtuple("Batch", "images labels")
    batch = Batch(*zip(*[(_image(i), i) for i in range(3)]))
    assert batch_size_of(batch) == 3
    pieces = split_batch(batch, 2)
    assert all(type(piece) is Batch for piece in pieces)
    _check(pieces, 3, [0, 1, 2])
    captions = [f"caption {i}" for i in range(4)]
    pieces = split_batch({"images": tuple(_image(i) for i in range(4)), "captions": tuple(captions)}, 2)
    _check([(piece["images"], piece["captions"]) for piece in pieces], 4, captions)


def test_a_dict_keeps_its_constant_and_default_collated_text_keeps_its_reading():
    """A dict's tuple of numbers stays a constant, so images beside one stay "cannot tell" (the
    error says to make the labels a tensor); default_collate's transposed text is no zip."""
    with pytest.raises(ValueError, match="cannot tell the batch's size.*Add a tensor"):
        batch_size_of({"images": tuple(_image(i) for i in range(4)), "labels": (0, 1, 2, 3)})
    text = [("a0", "a1", "a2", "a3"), ("b0", "b1", "b2", "b3")]
    pieces = split_batch((torch.arange(4), text), 2)
    assert [piece[1] for piece in pieces] == [[("a0", "a1"), ("b0", "b1")], [("a2", "a3"), ("b2", "b3")]]
