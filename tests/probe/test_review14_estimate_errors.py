"""An error of the step's own code during the fake-tensor trace comes out as itself (its type, so
the user's ``except`` catches it), with a note that the trace raised it; what fake tensors cannot
do stays an ``EstimateError`` (review 14)."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch import TrainStep, find_max_batch
from autobatch.probe.tracing.estimate import EstimateError
from autobatch.errors import add_note
from test_review11_probe_trial_notes import _Pairs  # splits its batch in pairs


def _step(loss, make_batch=lambda n: torch.randn(n, 16)) -> TrainStep:
    model = torch.nn.Linear(16, 4)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, make_batch)


def _checks_width(model, batch):
    if batch.shape[1] != 8:
        raise ValueError(f"expected 8 features, got {batch.shape[1]}")
    return model(batch).sum()


@pytest.mark.parametrize("step, kind, said", [
    (_step(_checks_width), ValueError, "expected 8 features"),  # the user's own check
    (_step(lambda m, b: m(b["x"]).sum(), lambda n: {"y": torch.randn(n, 16)}), KeyError, "'x'"),  # a collate's key
    (_step(lambda m, b: torch.nn.functional.cross_entropy(m(b), torch.zeros(3, dtype=torch.long))),
     ValueError, "to match target batch_size"),  # torch's check, on the user's behalf
    (_step(lambda m, b: m(b).sum(), lambda n: torch.randn(n, 16, dtype=torch.float64)),  # NumPy's float64 batch:
     RuntimeError, "m(at)?1 and m(at)?2 .*same dtype"),  # the fake addmm took it, and an answer came out
    (_step(lambda m, b: m(b.to("meta")).sum()), RuntimeError, "(same|expected) device"),
])
def test_the_steps_own_error_comes_out_as_itself_with_a_note(step, kind, said):
    with pytest.raises(kind, match=said) as caught:
        find_max_batch(step, memory_limit="4MiB", cache=False, strategy="estimate")
    assert not isinstance(caught.value, EstimateError)
    (note,) = caught.value.__notes__
    assert "traced it with fake tensors at batch" in note and "no step ran for real" in note
    assert "strategy='binary'" in note
    with pytest.raises(kind, match=said) as caught:  # auto: a note, then its trial raises the error for real
        find_max_batch(step, memory_limit="4MiB", cache=False, max_batch=64)
    assert not getattr(caught.value, "__notes__", None)


@torch.library.custom_op("autobatch_review14::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_no_fake.register_autograd(lambda ctx, grad: grad)  # trains for real; only its fake kernel is missing


@pytest.mark.parametrize("loss, said", [
    (lambda m, b: m(b).sum() * float(m(b).detach().numpy().sum()), r"\.numpy\(\) is not supported"),  # C raises it in the user's line
    (lambda m, b: _no_fake(m(b)).sum(), "no fake impl"),
])
def test_what_fake_tensors_cannot_do_stays_an_estimate_error(loss, said):
    step = _step(loss)
    with pytest.raises(EstimateError, match=said):
        find_max_batch(step, memory_limit="4MiB", cache=False, strategy="estimate")
    result = find_max_batch(step, memory_limit="4MiB", cache=False, max_batch=64)  # auto probes with trials
    assert result.tested and result.batch_size == 64
    assert any("no estimate for the first trial" in note for note in result.notes)


def test_a_note_without_add_note_is_kept_in_notes():
    """Python 3.10 has no ``BaseException.add_note``: the note goes in ``__notes__`` (the command line reads it)."""

    class Old(Exception):
        @property
        def add_note(self):
            raise AttributeError("add_note")

    error = add_note(add_note(Old("x"), "first"), "second")
    assert error.__notes__ == ["first", "second"]
    assert autobatch.EstimateError is EstimateError


def test_an_error_at_one_size_after_others_traced_says_to_pass_multiple_of():
    model = _Pairs()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                     lambda n: torch.randn(n, 16))
    with pytest.raises(RuntimeError, match="is invalid for input of size") as caught:
        find_max_batch(step, memory_limit="2MiB", cache=False, strategy="estimate")
    traced, sizes = caught.value.__notes__
    assert "traced it with fake tensors at batch" in traced
    assert "Pass multiple_of" in sizes and "every size traced is a multiple of 2" in sizes


def test_an_optimizer_reading_a_value_is_named_where_no_line_of_yours_is():
    model = torch.nn.Linear(16, 4)
    step = TrainStep(model, torch.optim.Adafactor(model.parameters()), lambda m, b: m(b).sum(), lambda n: torch.randn(n, 16))
    with pytest.raises(EstimateError, match=r"reads a tensor's value .*at \S+torch/optim/_adafactor\.py:\d+ in "):
        autobatch.estimate_memory(step, 4)


def test_a_compiled_model_is_estimated_uncompiled_and_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    plain = _step(lambda m, b: m(b).sum())
    plain.model, plain.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1)
    expected = find_max_batch(plain, memory_limit="256KiB", cache=False, strategy="estimate").batch_size
    compiled = TrainStep(torch.compile(model), plain.optimizer, plain.loss_fn, plain.make_batch)
    result = find_max_batch(compiled, memory_limit="256KiB", cache=False, strategy="estimate")
    assert result.batch_size == expected
    assert any("is compiled (torch.compile)" in note and "uncompiled code" in note for note in result.notes)
    # review 37: fullgraph=True is traced eagerly too (torch.compiler.set_stance), where it raised dynamo's
    # "found no compiled frames" (an EstimateError naming _orig_mod) and stayed unable to compile after the trace
    whole = TrainStep(torch.compile(model, fullgraph=True), plain.optimizer, plain.loss_fn, plain.make_batch)
    assert find_max_batch(whole, memory_limit="256KiB", cache=False, strategy="estimate").batch_size == expected


def test_review39_a_fake_convolutions_input_check_is_the_steps_own_error():
    """A ``Conv2d`` given 4 channels where it takes 3: PyTorch's fake convolution checks its input as the
    real one does, and its ``RuntimeError`` was an ``EstimateError`` saying fake tensors could not trace it."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 2, 1)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(),
                     lambda n: torch.randn(n, 4, 2, 2))
    with pytest.raises(RuntimeError, match="expected input.* to have 3 channels") as caught:
        autobatch.estimate_max_batch(step, "4MiB", max_batch=64)
    assert not isinstance(caught.value, EstimateError)
    assert "traced it with fake tensors at batch" in caught.value.__notes__[0]
