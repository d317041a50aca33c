"""Review 13: ``train.max_micro_batch`` below the micro-batch a probe found caps it (the Runner
refuses a ``micro_batch`` above ``max_micro_batch``, a key a command-line user never set)."""

from __future__ import annotations

import json
import sys

import pytest

from autobatch.__main__ import main


@pytest.fixture
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra


def test_a_probed_micro_batch_above_train_max_micro_batch_is_capped_at_it(tmp_path, _in_tmp):
    run = tmp_path / "run"
    args = ["train", "model=mlp", "data.shape=[16]", "model.width=32", "data.num_samples=64", "train.steps=2",
            "train.max_micro_batch=4", "probe.max_batch=16", "probe.memory_limit=8MiB", f"hydra.run.dir={run}"]
    assert main(args) == 0
    result = json.loads((run / "train_result.json").read_text())
    assert result["global_batch"] == 16 and result["steps"] == 2  # the probed batch, each step in pieces of 4
    assert result["micro_batch"] == 4 and result["initial_micro_batch"] == 4
