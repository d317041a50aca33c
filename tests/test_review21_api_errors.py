"""Bad inputs a hurried user types into the public API: each is one error, raised before any work,
that says what to change (not Python's bare arity error from the first trial, not torch's error
from inside a criterion or the accelerator runtime, not "must be positive" for 0.5)."""

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
