"""Review 23b: a model of one's own that cannot take the synthetic inputs names them.

``python -m autobatch train model=target model._target_=mymods.Net`` (8 input features) with the
default ``data.shape=[3, 32, 32]`` failed with torch's "mat1 and mat2 shapes cannot be multiplied
(768x32 and 8x16)", naming neither the inputs nor ``data.shape``. The error (its type and message
kept) now carries one note naming the inputs built and the keys to set, which the command line's
one-line error appends. (``probe_task``/``train_task`` enter :func:`inputs_noted` around the probe
and training; here the same context runs the probe in-process, as a Hydra run costs more than a test's budget.)
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf, open_dict

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import build_workload
from autobatch.cli.commands import run_probe
from autobatch.cli.errors import describe
from autobatch.cli.input_note import inputs_noted

OWN = ["model=target", "model._target_=torch.nn.Linear", "+model.in_features=8", "+model.out_features=10"]
CPU = ["device=cpu", "probe.memory_limit=1MiB", "device.simulated_budget=null", "probe.cache=false", "probe.max_batch=2",
       "probe.steps_per_trial=1", "probe.strategy=binary"]


@pytest.fixture(scope="module", autouse=True)
def _own() -> None:
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        COMPOSED.append(compose("probe", overrides=[*CPU, *OWN]))


COMPOSED: list[DictConfig] = []


def _cfg(**changes: object) -> DictConfig:
    """The composed config with ``changes`` (dotted keys; a compose per test costs too much)."""
    cfg = copy.deepcopy(COMPOSED[-1])
    with open_dict(cfg):
        for key, value in changes.items():
            OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def _probe(cfg):
    with inputs_noted(cfg) as watch:
        run_probe(cfg, watch(build_workload(cfg)))


def test_an_own_model_failing_on_the_default_shape_names_data_shape_and_keeps_torchs_error():
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as caught:
        _probe(_cfg())
    assert caught.value.__notes__[-1:] == [
        "torch.nn.Linear was fed synthetic inputs of data.shape=[3, 32, 32] per sample (a batch of N is "
        "[N, 3, 32, 32]), data.dtype=float32 (model.inputs=tensor); set data.shape to one sample's shape as "
        "torch.nn.Linear takes it (without the batch dimension; data.dtype for another dtype), or model.inputs=tokens "
        "for token ids"]
    message, code = describe(caught.value)
    assert message.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied") and code == 1
    assert message.count("data.shape=[3, 32, 32] per sample") == 1


def test_the_shape_it_takes_probes():
    _probe(_cfg(data__shape=[8]))  # the fix the note names works


def test_an_own_model_that_fits_no_batch_is_told_so_without_the_note():
    with pytest.raises(MemoryError) as caught:  # out of memory is not an input of the wrong shape
        _probe(_cfg(data__shape=[8], probe__memory_limit="1KiB", model__bias=False))
    assert not any("was fed synthetic inputs" in note for note in getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize("sample, fix", [
    ((np.zeros(8), 0), "each a numpy float64 array of shape [8] (data.dataset[0][0], collated by torch's default "
                       "collate); the model's weights are float32: return float32 inputs from __getitem__"),
    (([0.0] * 8, 0), "each a Python list of 8 items (float) (data.dataset[0][0], collated by torch's default collate); "
                     "torch's default collate turns a batch of lists into a list of 8 tensors"),
], ids=["numpy-float64", "python-list"])
def test_review33_a_dataset_the_own_model_cannot_take_names_its_inputs(sample, fix):
    # before, torch's "mat1 and mat2 must have the same dtype" / "must be Tensor, not list" alone
    from torch.utils.data import default_collate

    cfg = _cfg(data__dataset={"_target_": "mylab.data.DS"})
    model = torch.nn.Linear(8, 10)
    with pytest.raises((RuntimeError, TypeError)) as caught:
        with inputs_noted(cfg) as watch:
            watch(SimpleNamespace(model=model, dataset=[sample] * 4))
            model(default_collate([sample] * 4)[0])
    assert caught.value.__notes__[-1].startswith(
        "torch.nn.Linear was fed data.dataset=mylab.data.DS's inputs, " + fix)
