"""Review 29: a dataset of one's own whose inputs are not ``data.shape``'s size. The built-in models are
sized by ``data.shape`` (``model.in_shape``, ``model.in_channels`` read it), which a ``data.dataset`` leaves
at its default ``[3, 32, 32]``: ``train model=mlp 'data.dataset={_target_: mymods.DS}'`` with 8-feature
samples failed in the first forward as torch's "mat1 and mat2 shapes cannot be multiplied (8x8 and
3072x256)", exit status 1. It is now one line naming the ``data.shape`` to give (or the model key, when
the command line set that key itself). Judged on a composed config and a dataset's first sample."""

from __future__ import annotations

import pytest
import torch
from hydra import compose

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.user_config import composing
from autobatch.cli.validation import check_dataset_inputs


def _config(*overrides: str):
    with composing("train", None):
        return compose("train", overrides=["device=cpu", *overrides])


def test_an_mlp_sized_by_the_default_shape_names_the_datasets_shape():
    cfg = _config("model=mlp")
    with pytest.raises(ValueError) as caught:
        check_dataset_inputs(cfg, [(torch.zeros(8), 1)])
    assert str(caught.value) == ("model.in_shape=[3, 32, 32] does not suit data.dataset's inputs, float32 tensors of "
                                 "shape [8]; give data.shape=[8]")
    cfg.model.in_shape = [4]  # set by the user: that key is the one to change
    with pytest.raises(ValueError, match=r"model\.in_shape=\[4\] does not suit .*; give model\.in_shape=\[8\]$"):
        check_dataset_inputs(cfg, [(torch.zeros(8), 1)])
    cfg.model.in_shape = [2, 4]  # flattened by the MLP: the same number of features fits
    assert check_dataset_inputs(cfg, [(torch.zeros(8), 1)]).shape == (8,)


def test_a_cnn_with_other_channels_names_the_datasets_shape():
    cfg = _config("model=cnn")
    with pytest.raises(ValueError, match=r"^model\.in_channels=3 does not suit .*\[1, 16, 16\]; give data\.shape=\[1,16,16\]$"):
        check_dataset_inputs(cfg, [(torch.zeros(1, 16, 16), 0)])
    assert check_dataset_inputs(cfg, [(torch.zeros(3, 16, 16), 0)]).shape == (3, 16, 16)
