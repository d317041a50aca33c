"""Progress the runner lost, and a refused resume that changed the model anyway.

A resume from a checkpoint of another model raised ``CheckpointError`` ("start afresh") after
``load_state_dict`` had copied every entry that fitted: a run started afresh after it trained a
mix of two models. An unwritable ``checkpoint_dir`` failed at the first ``save()``, after
``checkpoint_every`` steps or the whole run. A step that fits at no micro-batch
(``StepOutOfMemoryError``) and a one-shot generator used up by a second epoch raised without
writing the steps trained since the last checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autobatch
from autobatch import CheckpointError, Runner, StepOutOfMemoryError
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


def _runner(model: nn.Module | None = None, **options) -> Runner:
    model = model if model is not None else make_model()
    options = {"global_batch": 16, "micro_batch": 8, "progress": False, "log_every": None, **options}
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mse, **options)


def test_a_resume_refused_for_another_model_loads_nothing(tmp_path):
    _runner(checkpoint_dir=tmp_path).fit(make_data())
    other = make_model(seed=3, width=24)  # its first layer's keys match, its shapes do not all
    before = weights(other)
    runner = _runner(other)
    with pytest.raises(CheckpointError, match="another model or optimizer.*size mismatch for 0.weight"):
        runner.fit(make_data(), resume=tmp_path)
    assert_weights_close(weights(other), before)  # bit-equal: nothing of the checkpoint was copied in
    assert runner.step == 0 and not runner.optimizer.state


def test_a_resume_refused_for_missing_layers_loads_nothing(tmp_path):
    _runner(checkpoint_dir=tmp_path).fit(make_data())
    deeper = make_model(seed=4, blocks=3)  # the checkpoint's keys all fit, one block more: missing keys
    before = weights(deeper)
    with pytest.raises(CheckpointError, match="missing key"):
        _runner(deeper).fit(make_data(), resume=tmp_path)
    for now, then in zip(weights(deeper), before, strict=True):
        assert torch.equal(now, then)


def test_an_unwritable_checkpoint_dir_is_one_error_when_the_runner_is_made(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="checkpoint_dir=.*a-file/ckpt.* cannot be written.*not a directory"):
        _runner(checkpoint_dir=blocker / "ckpt", checkpoint_every=2)
    fresh = tmp_path / "new" / "ckpt"
    _runner(checkpoint_dir=fresh)  # a folder still to be made is fine, and is not made by the check
    assert not (tmp_path / "new").exists()


def test_a_step_that_fits_nowhere_saves_the_steps_before_it(tmp_path):
    data = make_data(samples=64)
    reference = _runner()
    reference.fit(data)
    runner = _runner(checkpoint_dir=tmp_path, checkpoint_every=100)
    autobatch.inject_oom(runner, (2, "forward"), times=None)  # step 2 fails at every micro-batch
    with pytest.raises(StepOutOfMemoryError) as caught:
        runner.fit(data)
    assert any("2 steps trained are saved in" in note for note in caught.value.__notes__)
    assert load_checkpoint(tmp_path)["step"] == 2  # before, nothing: checkpoint_every was not reached
    resumed = _runner(make_model(seed=9))
    resumed.fit(data, resume=tmp_path)
    assert resumed.step == 4
    assert_weights_close(weights(resumed.model), weights(reference.model))


def test_a_give_up_in_a_fit_that_trained_nothing_keeps_the_earlier_checkpoint(tmp_path):
    data = make_data()
    _runner(checkpoint_dir=tmp_path).fit(data)
    runner = _runner(checkpoint_dir=tmp_path)
    autobatch.inject_oom(runner, (0, "forward"), times=None)
    with pytest.raises(StepOutOfMemoryError):
        runner.fit(data)
    assert load_checkpoint(tmp_path)["step"] == 3  # the earlier run's, not a step-0 one over it


def test_a_generator_used_up_by_a_second_epoch_saves_the_first(tmp_path):
    data = make_data()
    runner = _runner(checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="data yielded no batches in epoch 2") as caught:
        runner.fit((batch for batch in data), epochs=2)
    assert any("3 steps trained are saved" in note for note in caught.value.__notes__)
    saved = load_checkpoint(tmp_path)
    assert (saved["step"], saved["epoch"], saved["position"]) == (3, 1, 0)


# -- a later fit() on the same generator -----------------------------------------------------------
def _stream(batches: int):
    """A one-shot stream of global batches of 4, its samples numbered ``(x, y, ids)``."""
    data = make_data(samples=4 * batches, global_batch=4)
    yield from data


def test_a_second_fit_on_the_same_generator_goes_on_with_its_next_batch():
    """fit(stream, steps=3), then fit(stream, steps=6): the second skipped 3 batches of the
    generator, untrained, as a resume skips those a fresh iterator yields again."""
    seen: list[int] = []

    def loss_fn(model, batch):
        seen.extend(batch[2].tolist())
        return mse(model, batch)

    stream = _stream(10)
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=4, micro_batch=4,
                    progress=False, log_every=None)
    runner.fit(stream, steps=3)
    runner.fit(stream, steps=6)
    assert seen == list(range(24)) and runner.step == 6


def test_a_step_interrupted_on_a_generator_trains_its_batch_in_the_next_fit():
    trained: list[list[int]] = []
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        if calls["n"] == 3:  # step 1's second micro-batch
            raise KeyboardInterrupt
        return mse(model, batch)

    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=4, micro_batch=2,
                    progress=False, log_every=None)
    stream = _stream(4)
    with pytest.raises(KeyboardInterrupt):
        runner.fit(stream, steps=4, on_step_end=lambda info: trained.append(info["step"]))
    runner.fit(stream, steps=4, on_step_end=lambda info: trained.append(info["step"]))
    assert trained == [1, 2, 3, 4] and runner.result.samples == 12  # steps 2..4 in the second fit: 12 samples
