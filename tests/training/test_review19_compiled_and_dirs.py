"""A ``torch.compile``d model's checkpoints, and a fresh run over another run's checkpoint.

A compiled model is an ``OptimizedModule`` holding the model as ``_orig_mod``: its checkpoints
named every weight ``_orig_mod.0.weight``, so a run resumed without ``torch.compile`` (or a bare
run's checkpoint resumed with it) was refused as "written for another model". A checkpoint now
holds the bare model's names, and one of an earlier version, with the prefix, still resumes. So does a
model with a submodule compiled on its own (``self.enc = torch.compile(enc)``), whose keys held
``enc._orig_mod.`` inside them, which the checkpoint kept: refused again without ``torch.compile``.
The wrapper here is a stand-in with the real one's structure (a module named ``OptimizedModule``
whose child ``_orig_mod`` is the model): importing dynamo costs seconds, and the real
``torch.compile`` was checked by hand (a compiled run's ``last.pt`` resumed into the bare model).

A runner's first ``fit()`` without ``resume=`` overwrote another run's ``last.pt`` in its
``checkpoint_dir`` at its first save without a word; it now keeps it (moved aside, see
``test_review30_fresh_dir.py``) and warns, naming ``resume=``.

A model compiled with ``fullgraph=True`` that reaches ``torch._dynamo``'s recompile limit at a new
micro-batch size (an OOM replay's) raises ``FailOnRecompileLimitHit``; the runner's note blamed the
small size (BatchNorm) and said to raise ``min_micro_batch``. It now names the recompile limit and
``dynamic=``. The error here is a stand-in with the real one's name and module; the real one was
met by hand (``aot_eager``, ``dynamic=False``, ``recompile_limit=2``, three OOMs: the third size).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autobatch import Runner, inject_oom
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


class OptimizedModule(nn.Module):
    """Stand-in for ``torch._dynamo.eval_frame.OptimizedModule``: the model as ``_orig_mod``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(x)


class FailOnRecompileLimitHit(Exception):
    """Stand-in for ``torch._dynamo.exc.FailOnRecompileLimitHit`` (importing dynamo takes about a second)."""


FailOnRecompileLimitHit.__module__ = "torch._dynamo.exc"


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


def _compiled_block(seed: int) -> nn.Module:
    model = make_model(seed=seed)
    model[1] = OptimizedModule(model[1])  # a block compiled on its own: its keys hold 1._orig_mod.1.weight
    return model


def test_review37_a_compiled_submodules_checkpoint_resumes_without_compile_and_the_other_way(tmp_path):
    data = make_data()
    whole = make_model()
    _runner(whole).fit(data, steps=3)
    _runner(_compiled_block(0), checkpoint_dir=tmp_path / "compiled").fit(data, steps=2)
    assert "1.1.weight" in load_checkpoint(tmp_path / "compiled")["model"]  # the bare model's names
    bare = make_model(seed=5)
    _runner(bare, checkpoint_dir=tmp_path / "compiled").fit(data, steps=3, resume=tmp_path / "compiled")
    assert_weights_close(weights(bare), weights(whole))
    state = load_checkpoint(tmp_path / "compiled")  # and back, also as an earlier version wrote it (_orig_mod. inside)
    state["model"] = {key.replace("1.1.", "1._orig_mod.1."): value for key, value in state["model"].items()}
    torch.save(state, tmp_path / "inner.pt")
    for path in (tmp_path / "compiled", tmp_path / "inner.pt"):
        compiled = _compiled_block(5)
        _runner(compiled).fit(data, steps=3, resume=path)
        assert_weights_close(weights(compiled), weights(whole))


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


def test_review32_a_compiled_models_recompile_limit_at_a_replayed_size_is_named():
    def at_the_limit(model, batch):  # the replay's new size compiles once more than the limit allows
        if len(batch[0]) < 8:
            raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")
        return mse(model, batch)

    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.01), at_the_limit, global_batch=16, micro_batch=8,
                    progress=False, log_every=None)
    inject_oom(runner, at=(1, "forward"))
    with pytest.raises(FailOnRecompileLimitHit) as raised:
        runner.fit(make_data(), steps=3)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "recompile limit" in notes and "micro-batch 4 in global step 1" in notes and "dynamic=None" in notes
    assert "BatchNorm" not in notes and "min_micro_batch" not in notes  # not the small size's advice
    assert runner.step == 1 and "runner.save()" in notes  # the step before it stands
