"""Review 23: what an ML engineer tries after a first ``train``: overriding the optimizer's rate.

``train.lr=0.5 optimizer.lr=0.1`` trained at 0.1 with no word: the packaged ``optimizer.lr`` is
``${train.lr}``, and a value given to it replaces that link, leaving ``train.lr`` unread. The
run now warns, naming both keys; either key alone is no warning.

``data=dataset data.dataset._target_=mymods.DS`` (a dataset taking ``n, dim``) was refused one
packaged key at a time (``size``, then ``shape``, then ``num_classes``): three reruns. One line
now names them all with the ``~`` removals to give.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.ignored import ignored_keys
from autobatch.cli.validation import check_target_arguments

SMALL = ["model=mlp", "data.shape=[4]", "model.width=8", "device=cpu"]


@pytest.fixture(scope="module")
def composed():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        packaged = compose("train")
        yield lambda *overrides: [line for line in ignored_keys("train", compose("train", overrides=[*SMALL, *overrides]),
                                                                 packaged) if "train.lr" in line]


def test_train_lr_beside_an_optimizer_lr_of_its_own_is_named_as_ignored(composed):
    assert composed("train.lr=0.5", "optimizer.lr=0.1") == [
        "train.lr=0.5 is ignored: optimizer.lr=0.1 sets the optimizer's learning rate (give only one of them)"]


def test_train_lr_alone_is_no_warning(composed):
    assert composed("train.lr=0.5") == []  # it is the optimizer's lr


class _Pairs:
    """A dataset of the user's own: ``n`` samples of ``dim`` features."""

    def __init__(self, n: int = 4, dim: int = 2) -> None:
        self.n, self.dim = n, dim


def test_every_key_a_dataset_of_ones_own_does_not_take_is_named_in_one_line():
    # data=dataset keeps the packaged dataset's size, shape, num_classes: before, one rerun per key
    node = OmegaConf.create({"_target_": "mymods.Pairs", "size": 512, "shape": [4], "num_classes": 10, "n": 8})
    with pytest.raises(ValueError) as caught:
        check_target_arguments("data.dataset", node, _Pairs)
    assert str(caught.value) == (
        "data.dataset.size, data.dataset.shape, data.dataset.num_classes are not arguments of mymods.Pairs; "
        "its arguments: n, dim. Remove them with ~data.dataset.size ~data.dataset.shape ~data.dataset.num_classes")

