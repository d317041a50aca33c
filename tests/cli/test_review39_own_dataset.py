"""Review 39: a dataset of one's own whose samples differ in shape (variable-length sequences).

``python -m autobatch probe model=target model._target_=mypkg.SeqModel +data.dataset._target_=mypkg.SeqDataset``
(token sequences of 4 to 63 ids) warned that the probe cache was off, then failed in the first trial on
torch's "stack expects each tensor to be equal size, but got [20] at entry 0 and [27] at entry 1"
(``train train.micro_batch=8`` the same, at training's first batch), naming neither the dataset nor what
to change: the command line collates with torch's default collate and has no collate key. The dataset is
now refused before the probe in one line (:mod:`autobatch.cli.dataset_shapes`).
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import build_workload


class VarLengths(torch.utils.data.Dataset):
    """Token sequences of 3 + index ids, one class id each."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int):
        return torch.zeros(3 + index, dtype=torch.long), index % 2


def test_review39_a_dataset_of_variable_length_samples_is_one_line_before_the_probe():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("probe", overrides=["device=cpu", "model=target", "model._target_=torch.nn.EmbeddingBag",
                                          "+model.num_embeddings=8", "+model.embedding_dim=2",
                                          f"+data.dataset._target_={__name__}.VarLengths"])
    with pytest.raises(ValueError) as raised:
        build_workload(cfg)
    assert str(raised.value).startswith(
        f"data.dataset={__name__}.VarLengths: its samples' inputs differ in shape (data.dataset[0]'s [3], "
        "data.dataset[2]'s [5]): the command line batches samples with torch's default collate"), raised.value
    assert "has no collate key; return inputs of one shape from __getitem__ (pad or crop" in str(raised.value)


class Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor


class Scaled(VarLengths):
    def __init__(self, transform: Scale) -> None:
        self.transform = transform


def test_review39_a_nested_target_is_named_by_its_own_key():
    """``+data.dataset.transform._target_=mypkg.Scale`` without its ``factor`` was told ``give
    +data.dataset.factor=VALUE`` (which mypkg.Scaled refuses), and misspelt (``mypkg.Scal``) was Hydra's
    "Error loading 'mypkg.Scal' ... Are you sure that 'Scal' is importable", naming no key."""
    from omegaconf import OmegaConf

    from autobatch.cli.construct import construct

    for inner, said in ((f"{__name__}.Scale", f"data.dataset.transform: {__name__}.Scale rejected its arguments "
                         "(TypeError: Scale.__init__() missing 1 required positional argument: 'factor'); give "
                         "+data.dataset.transform.factor=VALUE"),
                        (f"{__name__}.Scal", f"data.dataset.transform._target_='{__name__}.Scal' cannot be imported "
                         f"({__name__} has no attribute 'Scal'; did you mean {__name__}.Scale?)")):
        cfg = OmegaConf.create({"data": {"dataset": {"_target_": f"{__name__}.Scaled", "transform": {"_target_": inner}}}})
        with pytest.raises(ValueError) as raised:
            construct("data.dataset", cfg.data.dataset)  # Hydra's full_key is from the root: data.dataset.transform
        assert str(raised.value).startswith(said), raised.value
