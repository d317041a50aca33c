"""A ``torch.compile``d model's checkpoints, and a fresh run over another run's checkpoint.

A compiled model is an ``OptimizedModule`` holding the model as ``_orig_mod``: its checkpoints
named every weight ``_orig_mod.0.weight``, so a run resumed without ``torch.compile`` (or a bare
run's checkpoint resumed with it) was refused as "written for another model". A checkpoint now
holds the bare model's names, and one of an earlier version, with the prefix, still resumes.
The wrapper here is a stand-in with the real one's structure (a module named ``OptimizedModule``
whose child ``_orig_mod`` is the model): importing dynamo costs seconds, and the real
``torch.compile`` was checked by hand (a compiled run's ``last.pt`` resumed into the bare model).

A runner's first ``fit()`` without ``resume=`` overwrote another run's ``last.pt`` in its
``checkpoint_dir`` at its first save without a word; it now keeps it (moved aside, see
``test_review30_fresh_dir.py``) and warns, naming ``resume=``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


class OptimizedModule(nn.Module):
    """Stand-in for ``torch._dynamo.eval_frame.OptimizedModule``: the model as ``_orig_mod``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(x)


def _runner(model: nn.Module, **options) -> Runner:
    return Runner(model, torch.optim.Adam(model.parameters(), lr=0.01), mse, global_batch=16, micro_batch=8,
                  progress=False, log_every=None, **options)


def test_a_compiled_runs_checkpoint_resumes_without_compile_and_the_other_way(tmp_path):
    data = make_data()
    whole = make_model()
    _runner(whole).fit(data, steps=3)
    _runner(OptimizedModule(make_model()), checkpoint_dir=tmp_path / "compiled").fit(data, steps=2)
    assert all(not key.startswith("_orig_mod.") for key in load_checkpoint(tmp_path / "compiled")["model"])
    bare = make_model(seed=5)
    _runner(bare, checkpoint_dir=tmp_path / "compiled").fit(data, steps=3, resume=tmp_path / "compiled")
    assert_weights_close(weights(bare), weights(whole))
    compiled = OptimizedModule(make_model(seed=5))  # and back: the bare run's checkpoint, compiled
    _runner(compiled).fit(data, steps=3, resume=tmp_path / "compiled")
    assert_weights_close(weights(compiled), weights(whole))


def test_a_checkpoint_with_the_compiled_prefix_of_an_earlier_version_resumes(tmp_path):
    data = make_data()
    runner = _runner(make_model(), checkpoint_dir=tmp_path)
    runner.fit(data, steps=2)
    state = load_checkpoint(tmp_path)
    state["model"] = {f"_orig_mod.{key}": value for key, value in state["model"].items()}
    torch.save(state, tmp_path / "last.pt")
    bare = make_model(seed=5)
    _runner(bare).fit(data, steps=2, resume=tmp_path)  # loaded, nothing left to train
    assert_weights_close(weights(bare), weights(runner.model))


def test_a_fresh_run_warns_once_of_another_runs_checkpoint_it_keeps(tmp_path, caplog):
    data = make_data()
    _runner(make_model(), checkpoint_dir=tmp_path).fit(data, steps=1)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        again = _runner(make_model(), checkpoint_dir=tmp_path)
        again.fit(data, steps=1)  # afresh over it: warned once
        again.fit(data, steps=2)  # its own checkpoint, continued: no warning
        _runner(make_model(), checkpoint_dir=tmp_path).fit(data, steps=3, resume=tmp_path)  # resumed: none
    warned = [r.getMessage() for r in caplog.records if "already holds a checkpoint" in r.getMessage()]
    kept = tmp_path / "last.earlier-1.pt"
    assert len(warned) == 1 and f"resume={str(kept)!r}" in warned[0] and kept.is_file()
