"""Inputs that failed late or passed silently now get one clear message naming what to change:
a TrainStep's autocast dtype and grad scaler, a model given as the step, NumPy integers,
truthy strings for booleans, and a cache directory that reads as a boolean."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import TrainStep, checks, find_max_batch


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    return (model, optimizer, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
            lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,))))


def _one_error(error, match, call):
    with pytest.raises(error, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)
    return caught.value


@pytest.mark.parametrize(("given", "dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                              ("torch.bfloat16", torch.bfloat16), (torch.float32, torch.float32),
                                              (None, None)])
def test_an_autocast_dtype_is_taken_by_name(given, dtype):
    """Before: the name reached torch.autocast, "argument 'dtype' must be torch.dtype, not str"."""
    step = TrainStep(*_parts(), autocast_dtype=given)
    assert step.autocast_dtype is dtype
    assert find_max_batch(step, memory_limit="1MiB", cache=False, strategy="binary").batch_size > 1


@pytest.mark.parametrize("given", [torch.int8, torch.float64, "int8", "float17", 16])
def test_an_autocast_dtype_autocast_cannot_run_is_refused(given):
    """Before: torch.int8 was taken without a word."""
    _one_error(ValueError, r"autocast_dtype=.* (is not one of bfloat16, float16, float32|is not a torch dtype)",
               lambda: TrainStep(*_parts(), autocast_dtype=given))


@pytest.mark.parametrize("given", [True, "cpu", object()])
def test_a_grad_scaler_that_is_not_one_is_refused(given):
    """Before: AttributeError: 'bool' object has no attribute 'is_enabled', in the first trial."""
    _one_error(TypeError, r"grad_scaler must be a torch.amp.GradScaler or None, got .*torch.amp.GradScaler\(device\)",
               lambda: TrainStep(*_parts(), grad_scaler=given))
    assert TrainStep(*_parts(), grad_scaler=torch.amp.GradScaler("cpu")).grad_scaler is not None


def test_a_model_given_as_the_step_is_refused_before_any_trial():
    """Before: "linear(): argument 'input' must be Tensor, not int" from the first trial."""
    model = _parts()[0]
    _one_error(TypeError, r"fn is a model \(Linear\), not a training step.*autobatch.TrainStep\(model, optimizer",
               lambda: find_max_batch(model, memory_limit="1MiB", strategy="binary"))


@pytest.mark.parametrize("integer", [np.int64(8), np.int32(8), np.uint16(8), torch.tensor(8)])
def test_numpy_integers_are_taken_and_stored_as_int(integer, tmp_path):
    """Before: "start must be a positive integer or None, got np.int64(8)"."""
    step = TrainStep(*_parts())
    result = find_max_batch(step, memory_limit="1MiB", start=integer, max_batch=integer * 64, multiple_of=integer // 8,
                            steps_per_trial=integer // 4, search_steps=integer // 8, cache=tmp_path)
    assert result.trials[0].batch_size == 8 and type(result.trials[0].batch_size) is int
    assert type(result.batch_size) is int
    assert find_max_batch(step, memory_limit="1MiB", start=integer, max_batch=integer * 64, multiple_of=integer // 8,
                          steps_per_trial=integer // 4, search_steps=integer // 8, cache=tmp_path).cached


@pytest.mark.parametrize(("name", "value"), [("start", True), ("start", 8.0), ("max_batch", np.float64(64)),
                                             ("multiple_of", False), ("steps_per_trial", 2.0),
                                             ("search_steps", np.bool_(True)), ("start", torch.tensor(True))])
def test_bools_and_floats_are_still_refused(name, value):
    _one_error(ValueError, f"{name} must be a positive integer",
               lambda: find_max_batch(TrainStep(*_parts()), memory_limit="1MiB", cache=False, **{name: value}))


def test_the_checks_take_any_integer_and_real_type():
    assert checks.positive_int("n", np.int64(3)) == 3 and type(checks.positive_int("n", np.int64(3))) is int
    assert checks.positive_int("n", None, allow_none=True) is None
    assert checks.positive_number("x", np.float32(0.5)) == 0.5
    for bad in (True, 0, -1, 1.0, "3"):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            checks.positive_int("n", bad)
    with pytest.raises(ValueError, match="x must be a positive number"):
        checks.positive_number("x", np.bool_(True))


@pytest.mark.parametrize("value", ["no", "false", "True", 0, 1])
def test_estimate_first_must_be_a_bool(value):
    """Before: "no" is truthy, so the estimate placed the first trial."""
    _one_error(TypeError, r"estimate_first must be True, False or None",
               lambda: find_max_batch(TrainStep(*_parts()), memory_limit="1MiB", estimate_first=value, cache=False))


def test_a_boolean_word_names_the_bool_to_pass():
    error = _one_error(TypeError, "estimate_first must be", lambda: find_max_batch(
        TrainStep(*_parts()), memory_limit="1MiB", estimate_first="no", cache=False))
    assert "pass estimate_first=False" in str(error)


@pytest.mark.parametrize("call", [
    lambda s: autobatch.estimate_max_batch(s, "2MiB", include_resident="no"),
    lambda s: autobatch.probe.tracing.estimate.estimate_line(s, "2MiB", include_resident="no"),
    lambda s: autobatch.probe.tracing.estimate.estimate_peak(s, 8, include_resident="no"),
])
def test_include_resident_must_be_a_bool(call):
    """Before: "no" counted the resident model, as True does."""
    error = _one_error(TypeError, "include_resident must be True or False, got str 'no'", lambda: call(TrainStep(*_parts())))
    assert "include_resident=False" in str(error)


@pytest.mark.parametrize(("value", "named"), [("false", "cache=False"), ("no", "cache=False"), (" Off ", "cache=False"),
                                              ("true", "cache=True"), ("0", "cache=False")])
def test_a_cache_string_that_reads_as_a_boolean_is_refused(value, named, tmp_path, monkeypatch):
    """Before: cache="false" made a cache directory named ./false."""
    monkeypatch.chdir(tmp_path)
    _one_error(ValueError, f"cache={value!r} reads as a boolean.*pass {named}",
               lambda: find_max_batch(TrainStep(*_parts()), memory_limit="1MiB", cache=value))
    assert os.listdir(tmp_path) == []


def test_a_cache_path_of_that_name_is_still_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = find_max_batch(TrainStep(*_parts()), memory_limit="1MiB", cache="./false")
    assert (tmp_path / "false").is_dir() and not result.cached
