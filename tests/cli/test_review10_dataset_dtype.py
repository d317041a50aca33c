"""Review 10: a ``data.dataset`` whose inputs are float64 (numpy's default: ``np.random.rand``,
``np.load`` of most arrays) for a built-in float32 model.

The probe's first trial failed inside torch: ``autobatch: error: RuntimeError: mat1 and mat2
must have the same dtype, but got Double and Float``, exit status 1 (a failure at run time), naming
neither the key nor the fix, where a synthetic ``data.dtype`` that does not match is one line
naming it with exit status 2. Autocast (``precision=bf16``) does not cast float64 inputs either
("Double and BFloat16"); it does cast float16 ones.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from conftest import SMALL


class Float64Samples(Dataset):
    """(input, target) pairs whose inputs are float64: ``numpy`` arrays, or tensors."""

    def __init__(self, size: int = 64, as_numpy: bool = True, dtype: str = "float64") -> None:
        self.size, self.as_numpy, self.dtype = size, as_numpy, dtype

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        if index >= self.size:
            raise IndexError(index)
        inputs = np.random.default_rng(index).random(16).astype(self.dtype)  # numpy's default: float64
        return (inputs if self.as_numpy else torch.from_numpy(inputs)), index % 10


def _one_error(done) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autobatch: error: "), done.stderr
    return lines[0]


def test_float64_numpy_inputs_for_a_float32_model_are_bad_input_naming_the_dataset(cli_here):
    done = cli_here("probe", "model=mlp", *SMALL, "data.dataset={_target_: test_review10_dataset_dtype.Float64Samples}")
    assert done.returncode == 2, done.stderr
    line = _one_error(done)
    assert "data.dataset" in line and "float64" in line and "float32" in line and "precision=" in line, line


def test_float64_tensor_inputs_are_named_for_train_too(cli_here):
    dataset = "data.dataset={_target_: test_review10_dataset_dtype.Float64Samples, as_numpy: false}"
    done = cli_here("train", "model=mlp", *SMALL, dataset, "train.steps=1")
    assert done.returncode == 2, done.stderr
    assert "data.dataset" in _one_error(done)


def test_autocast_does_not_cast_float64_inputs(cli_here):
    dataset = "data.dataset={_target_: test_review10_dataset_dtype.Float64Samples}"
    done = cli_here("probe", "model=mlp", *SMALL, dataset, "precision=bf16")
    assert done.returncode == 2, done.stderr
    assert "data.dataset" in _one_error(done)


def test_float16_inputs_train_under_autocast_and_float32_ones_without(cli_here, tmp_path):
    half = "data.dataset={_target_: test_review10_dataset_dtype.Float64Samples, dtype: float16}"
    done = cli_here("train", "model=mlp", *SMALL, half, "precision=bf16", "train.steps=1")
    assert done.returncode == 0, done.stderr
    single = "data.dataset={_target_: test_review10_dataset_dtype.Float64Samples, dtype: float32}"
    done = cli_here("probe", "model=mlp", *SMALL, single, f"hydra.run.dir={tmp_path / 'probe'}", dirs=False)
    assert done.returncode == 0, done.stderr
