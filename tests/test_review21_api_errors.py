"""Bad inputs a hurried user types into the public API: each is one error, raised before any work,
that says what to change (not Python's bare arity error from the first trial, not torch's error
from inside a criterion or the accelerator runtime, not "must be positive" for 0.5)."""

import numpy as np
import pytest
import torch

import autobatch as ab


def _model_and_optimizer(device: str = "cpu"):
    model = torch.nn.Linear(4, 2, device=device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step() -> ab.TrainStep:
    model, optimizer = _model_and_optimizer()
    return ab.TrainStep(model, optimizer, lambda m, b: m(b).mean(), lambda n: torch.randn(n, 4))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # Lightning's mode name: the strategy it means is named
        (lambda: ab.find_max_batch(_step(), strategy="binsearch"), ValueError, "did you mean strategy='binary'"),
        # fn(batch_size) cannot bind: refused before the first trial
        (lambda: ab.find_max_batch(lambda model, batch_size: None), TypeError, r"fn is called as fn\(batch_size\)"),
        # a criterion is callable, but as criterion(output, target): failed inside torch at the first step
        (lambda: ab.TrainStep(*_model_and_optimizer(), torch.nn.CrossEntropyLoss(), lambda n: torch.randn(n, 4)),
         TypeError, r"CrossEntropyLoss\(\) is a criterion.*loss_fn=lambda model, batch"),
        # a model built on the meta device: failed in the snapshot with an accelerator error
        (lambda: ab.Runner(*_model_and_optimizer("meta"), lambda m, b: m(b).mean(), global_batch=8),
         ValueError, r"on the meta device \(weight, bias\).*to_empty"),
        # the decorator resolved the device inside torch: "Cannot access accelerator device when none is available"
        (lambda: ab.find_executable_batch_size(lambda batch_size: batch_size, device="cuda")(), ValueError,
         "this machine has no cuda device"),
        (lambda: ab.parse_bytes("80%"), ValueError, r"a percentage is not taken.*memory_limit=int\(0.8 \*"),
        (lambda: ab.parse_bytes(0.5), ValueError, "less than one byte: did you mean '0.5GiB'"),
        (lambda: ab.format_bytes("8GiB"), TypeError, "use parse_bytes"),
        (lambda: ab.Runner(*_model_and_optimizer(), lambda m, b: m(b).mean(), global_batch=8, step_guard="gpu"),
         ValueError, "did you mean step_guard='device'"),
        (lambda: ab.plan(_step(), global_batch=8, objective="fastest"), ValueError, "did you mean objective='throughput'"),
        (lambda: ab.Runner(*_model_and_optimizer(), lambda m, b: m(b).mean(), batch_size=8), TypeError,
         r"Runner\(\) got an unexpected keyword argument 'batch_size'; did you mean 'global_batch'\?"),
        (lambda: ab.Runner(*_model_and_optimizer(), lambda m, b: m(b).mean(), global_batch=8).fit([], max_epochs=1),
         TypeError, "did you mean 'epochs'"),
        (lambda: ab.find_max_batch(_step(), starting_batch_size=64), TypeError,
         r"find_max_batch\(\) got an unexpected keyword argument 'starting_batch_size'; did you mean 'start'\?"),
        (lambda: ab.TrainStep(*_model_and_optimizer(), criterion=lambda m, b: m(b).mean()), TypeError,
         "did you mean 'loss_fn'"),
        # torchvision's detection models return their loss terms, no "loss": the sum is named
        (lambda: ab.TrainStep(*_model_and_optimizer(), lambda m, b: {"loss_classifier": m(b).mean(), "loss_box_reg": m(b).sum()},
                              lambda n: torch.randn(n, 4))(2), TypeError, r"loss terms \(loss_classifier, loss_box_reg\).*sum\("),
        (lambda: _step()(0), ValueError, "batch_size"),
        (lambda: ab.plan(_step(), global_batch=8, starting_batch_size=8), TypeError, "did you mean 'start'"),
    ],
    ids=["strategy-alias", "step-arity", "criterion-loss", "meta-model", "decorator-device", "percent", "half-byte",
         "format-string", "guard-alias", "objective-alias",
         "runner-keyword", "fit-keyword", "find-keyword", "trainstep-keyword", "loss-terms", "empty-step", "plan-keyword"],
)
def test_a_bad_input_is_one_error_naming_what_to_change(call, error, match):
    if "cuda" in match and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(error, match=match):
        call()


def test_review31_a_model_and_optimizer_swapped_is_one_line_naming_the_order():
    """``TrainStep(optimizer, model, ...)``, ``Runner(optimizer, model, ...)`` and ``restore=(optimizer, model)``
    said "model must be a torch.nn.Module, got AdamW AdamW (" and then the optimizer's repr over several
    lines, not that the two were swapped; a model's repr in any such error spanned lines too."""
    model, optimizer = _model_and_optimizer()
    model = torch.nn.Sequential(model, torch.nn.ReLU())
    calls = [
        lambda: ab.TrainStep(optimizer, model, lambda m, b: m(b).mean(), lambda n: torch.randn(n, 4)),
        lambda: ab.Runner(optimizer, model, lambda m, b: m(b).mean(), global_batch=8),
        lambda: ab.find_max_batch(lambda n: None, restore=(optimizer, model)),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="got the optimizer SGD: pass the model first, then its optimizer") as caught:
            call()
        assert "\n" not in str(caught.value)
    with pytest.raises(TypeError, match=r"restore must be a \(model, optimizer\) pair") as caught:
        ab.find_max_batch(lambda n: None, restore=model)
    assert "\n" not in str(caught.value)


def _probe_result() -> ab.ProbeResult:
    return ab.ProbeResult(batch_size=8, strategy="binary", strategy_used="binary", trials=[], capacity_bytes=None,
                          elapsed_s=0.0, margin=0.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        # each failed as Python's bare error from inside: "'str' object is not callable" (after a step had trained,
        # for on_step_end), "'Linear' object has no attribute 'optimizer'", "'int' object is not iterable", ...
        (lambda: ab.Runner(*_model_and_optimizer(), lambda m, b: m(b).mean(), global_batch=4).fit(
            [torch.randn(4, 4)], on_step_end="log"), "on_step_end must be a callable"),
        (lambda: ab.accumulate_gradients(torch.nn.Linear(4, 2), lambda m, b: m(b).mean(), torch.randn(4, 4), 2,
                                         no_sync=True), "no_sync must be a callable"),
        (lambda: ab.accumulated_step(torch.nn.Linear(4, 2), [torch.randn(2, 4)], global_batch=2),
         "step must be an autobatch.TrainStep, got Linear"),
        (lambda: ab.accumulated_step(_step(), torch.randn(4, 4), global_batch=4), r"micro_batches must be a list.*split_batch"),
        (lambda: ab.FaultInjector(at=3), r"at must be one \(step, phase\) pair"),
        (lambda: ab.inject_oom(torch.nn.Linear(4, 2), at=(1, "forward")), "runner must be an autobatch.Runner, got Linear"),
        (lambda: ab.estimate_memory(_step(), 4, op_limit="1e6"), "op_limit must be a positive integer or None"),
        (lambda: ab.plot_probe(_probe_result(), "curve.png", plan="plan.json"), "plan must be the Plan autobatch.plan"),
        (lambda: ab.plot_probe(_probe_result(), None), "path must be the PNG file"),
        (lambda: ab.plot_sweep(3, "sweep.png"), "plot_sweep takes the sweep's rows"),
        (lambda: ab.cache.list_entries(0), "the cache directory must be a str or Path"),
        (lambda: ab.enable_checkpointing(torch.nn.Sequential(torch.nn.Linear(4, 4)), modules=0), "modules must be qualified"),
        (lambda: ab.TrainStep(*_model_and_optimizer(), lambda m, b: m(b).mean(), None)(2), "built with make_batch=None"),
    ],
    ids=["on-step-end", "no-sync", "step-a-model", "micro-batches-a-tensor", "fault-at", "inject-a-model", "op-limit",
         "plot-plan", "plot-path", "sweep-rows", "cache-dir", "checkpoint-modules", "no-make-batch"],
)
def test_review36_a_wrong_kind_of_argument_is_one_error_naming_it(call, match):
    with pytest.raises(TypeError if "op_limit" not in match else ValueError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_review36_a_flag_is_a_bool_and_a_numpy_step_is_a_step():
    """``micro_batch_sizes(balanced="no")`` and ``accumulated_step(lazy="no")`` read a string as True without a
    word (split_batch refused it); ``FaultInjector(at=(np.int64(3), "forward"))`` was refused as no integer."""
    with pytest.raises(TypeError, match="balanced must be True or False"):
        ab.micro_batch_sizes(10, 4, balanced="no")
    with pytest.raises(TypeError, match="lazy must be True or False"):
        ab.accumulated_step(_step(), [torch.randn(2, 4)], global_batch=2, lazy="no")
    assert ab.FaultInjector(at=(np.int64(3), "forward")).points == {(3, "forward")}
    assert ab.FaultInjector(at=[3, "forward"]).points == {(3, "forward")}
