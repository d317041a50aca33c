"""The built-in workloads refuse a size of 0 or below in their constructors, naming the argument
(review 13c): ``data=dataset data.dataset.size=-5`` failed inside torch ("Trying to create tensor
with negative dimension"), which the command line reported as a failure at run time, exit 1."""

from __future__ import annotations

import pytest

from autobatch.cli.construct import construct
from autobatch.cli.errors import BAD_INPUT, describe
from autobatch.workloads.batches import RandomClassification, SyntheticBatches
from autobatch.workloads.models import GPT, MLP, ResNetCNN


@pytest.mark.parametrize("build, named", [
    (lambda: RandomClassification(-5, (3,), 10), "RandomClassification size"),
    (lambda: RandomClassification(4, (3, 0), 10), "RandomClassification shape"),
    (lambda: RandomClassification(4, 3, 10), "RandomClassification shape"),
    (lambda: RandomClassification(4, (3,), 0), "RandomClassification num_classes"),
    (lambda: SyntheticBatches(inputs="tensor", shape=(-1, 8)), "SyntheticBatches shape"),
    (lambda: SyntheticBatches(inputs="tokens", vocab_size=0), "SyntheticBatches vocab_size"),
    (lambda: SyntheticBatches(inputs="tokens", seq_len=-2), "SyntheticBatches seq_len"),
    (lambda: MLP((16, -1), 4), "MLP in_shape"),
    (lambda: ResNetCNN(0, 4), "ResNetCNN in_channels"),
    (lambda: GPT(32, 16, heads=0), "GPT heads"),  # was a ZeroDivisionError
    (lambda: GPT(32, -1), "GPT max_seq_len"),
])
def test_a_size_of_zero_or_below_is_one_error_naming_the_argument(build, named):
    with pytest.raises(ValueError, match=f"^{named} must be "):
        build()


def test_valid_sizes_still_build():
    data = RandomClassification(4, [3, 2], 5)  # a list, as the command line gives it
    assert len(data) == 4 and data[0][0].shape == (3, 2)
    assert SyntheticBatches(inputs="tensor", shape=())(3)[0].shape == (3,)  # scalar samples


def test_the_command_line_reports_a_negative_dataset_size_as_bad_input():
    """What ``data=dataset data.dataset.size=-5`` builds: one line naming the key, exit status 2."""
    node = {"_target_": "autobatch.workloads.batches.RandomClassification", "size": -5, "shape": [3], "num_classes": 10}
    with pytest.raises(ValueError) as caught:
        construct("data.dataset", node)
    message, code = describe(caught.value)
    assert code == BAD_INPUT and message.startswith("data.dataset: ")
    assert "RandomClassification size must be a positive integer, got -5" in message
