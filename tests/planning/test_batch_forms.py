"""What a batch may hold: each micro-batch gets what ``default_collate`` gives its samples, the
usual custom collates (per-sample dicts, token lists) split per sample, a constant stays whole,
and what cannot be told is one error naming its place in the batch."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

import autobatch
from autobatch.planning.accumulation import batch_size_of, split_batch
from autobatch.planning.samples import cycle_samples, map_samples

Pair = collections.namedtuple("Pair", "x name")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _sample(form: str, i: int):
    x = torch.arange(3.0) + i
    return {
        "tuple": (x, i),
        "text": {"x": x, "name": f"f{i}", "label": i % 3},
        "number pairs": {"x": x, "pair": [i, i + 1]},
        "text pairs": {"x": x, "caps": [f"a{i}", f"b{i}"]},
        "text triples": {"x": x, "caps": (f"a{i}", f"b{i}", f"c{i}")},
        "named": Pair(x, f"n{i}"),
        "tuple of dicts": ({"ids": x, "mask": x > i}, {"labels": i}),
        "floats": (x, float(i)),
    }[form]


@pytest.mark.parametrize("form", ["tuple", "text", "number pairs", "text pairs", "text triples", "named",
                                  "tuple of dicts", "floats"])
def test_each_micro_batch_is_what_default_collate_gives_its_samples(form):
    """Batches of 1 to 6 samples, every micro-batch size, both split policies: a piece of the
    collated batch is the collate of its samples (default_collate's transposed lists included)."""
    for size in range(1, 7):
        samples = [_sample(form, i) for i in range(size)]
        batch = default_collate(samples)
        assert batch_size_of(batch) == size
        for micro in range(1, size + 1):
            for balanced in (False, True):
                start = 0
                for piece in split_batch(batch, micro, balanced=balanced):
                    count = batch_size_of(piece)
                    assert _same(piece, default_collate(samples[start:start + count])), (size, micro, balanced)
                    start += count


def test_custom_collates_split_per_sample_and_constants_stay_whole():
    """A fixed (H, W) tuple was split when the batch had 2 samples; variable-length token lists
    were not split; a list of per-sample target dicts failed with 'batch tensors disagree on dim 0:
    sizes [1, 2, 3, 4, 5]', naming neither the leaf nor the form."""
    hw = {"x": torch.randn(2, 4), "hw": (32, 48)}
    assert [piece["hw"] for piece in split_batch(hw, 1)] == [(32, 48), (32, 48)]
    tokens = {"x": torch.randn(4, 4), "tokens": [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]}
    assert [piece["tokens"] for piece in split_batch(tokens, 2)] == [[[1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10]]]
    targets = [{"boxes": torch.randn(k, 4), "labels": torch.zeros(k)} for k in (1, 3, 2, 5)]
    detection = (torch.randn(4, 4), targets)
    assert batch_size_of(detection) == 4
    pieces = split_batch(detection, 2)
    assert [[t["boxes"].shape[0] for t in piece[1]] for piece in pieces] == [[1, 3], [2, 5]]
    assert pieces[1][1][1] is targets[3]  # entries kept whole
    images = tuple(torch.randn(3, 8 + i, 8) for i in range(4))  # torchvision's tuple(zip(*batch))
    assert [len(piece[0]) for piece in split_batch((images, tuple(targets)), 3)] == [3, 1]
    assert [t["boxes"].shape[0] for t in cycle_samples(detection, 6, 4)[1]] == [1, 3, 2, 5, 1, 3]


def test_what_cannot_be_told_is_one_error_naming_its_place():
    with pytest.raises(ValueError, match=r"batch\['lengths'\] is a list of 4 numbers in a batch of 4 samples.*tensor"):
        split_batch({"x": torch.randn(4, 2), "lengths": [3, 1, 2, 4]}, 2)
    assert [p["shape"] for p in split_batch({"x": torch.randn(4, 2), "shape": [224, 224]}, 2)] == [[224, 224]] * 2
    with pytest.raises(ValueError, match=r"disagree on dim 0 .*batch\['x'\] has 8, batch\['y'\] has 7"):
        batch_size_of({"x": torch.randn(8, 2), "y": torch.randn(7)})
    with pytest.raises(ValueError, match=r"disagree on dim 0 .*batch\['t'\]\[0\] has 2"):
        batch_size_of({"x": torch.randn(4, 2), "t": [torch.randn(2), torch.randn(3), torch.randn(5)]})
    with pytest.raises(ValueError, match=r"cannot tell the batch's size: it fits 2 or 3 samples .*batch\['imgs'\]\[0\]"):
        batch_size_of({"imgs": [torch.randn(3, 4), torch.randn(3, 5)]})
    three = (torch.randn(4, 2), [torch.randn(2), torch.randn(3), torch.randn(5)])  # neither fields nor per sample
    with pytest.raises(ValueError, match=r"batch\[1\] is a list of 3 entries in a batch of 4 samples"):
        map_samples(three, lambda tensor: tensor, lambda values: values, 4)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.BatchNorm1d(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _batchnorm_step() -> autobatch.TrainStep:
    """Blocks with BatchNorm, which cannot train on one sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), *[_Block(128) for _ in range(4)], nn.Linear(128, 10))
    return autobatch.TrainStep(model, torch.optim.Adam(model.parameters()),
                               lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda size: (torch.randn(size, 32), torch.randint(0, 10, (size,))))


def test_plan_notes_an_error_of_a_trial_at_batch_one():
    """Under a tight budget the probe went down to batch 1, where BatchNorm raised its own
    ValueError: plan() let it through with nothing saying the search led there."""
    step = _batchnorm_step()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        autobatch.plan(step, global_batch=64, memory_limit="700KiB", device="cpu", cache=False)
    note = "\n".join(caught.value.__notes__)
    assert "probe trial at batch 1" in note and "multiple_of=2" in note


def test_find_max_batch_notes_an_error_of_a_trial_at_batch_one_as_plan_does():
    """The note is added where the trial runs, so a probe without plan() gets it too."""
    step = _batchnorm_step()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        autobatch.find_max_batch(step, memory_limit="700KiB", device="cpu", cache=False)
    assert len(caught.value.__notes__) == 1
    assert "probe trial at batch 1" in caught.value.__notes__[0] and "multiple_of=2" in caught.value.__notes__[0]
