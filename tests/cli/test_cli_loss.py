"""The CLI's loss reads logits from every common output form (tensor, ``.logits``, tuple)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn import functional as F

from autobatch.cli.build import cross_entropy_loss


@dataclass
class Output:  # the shape of a Hugging Face ModelOutput: logits as an attribute
    logits: torch.Tensor
    past_key_values: object = None


class Returns(torch.nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 5)
        self.wrap = wrap

    def forward(self, tokens):
        return self.wrap(self.embed(tokens))


@pytest.mark.parametrize("wrap", [lambda x: x, Output, lambda x: (x, None), lambda x: [x]], ids=["tensor", "logits", "tuple", "list"])
def test_the_loss_reads_logits_from_each_output_form(wrap):
    torch.manual_seed(0)
    model = Returns(wrap)
    tokens, targets = torch.randint(0, 11, (3, 4)), torch.randint(0, 5, (3, 4))
    expected = F.cross_entropy(model.embed(tokens).reshape(-1, 5), targets.reshape(-1))
    assert torch.allclose(cross_entropy_loss(model, (tokens, targets)), expected)


def test_an_output_without_logits_names_what_to_change():
    model = Returns(lambda x: {"hidden": x})
    with pytest.raises(TypeError, match=r"returned dict, not logits.*\.logits"):
        cross_entropy_loss(model, (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)))


# -- review 32: the loss group ----------------------------------------------------------------
@pytest.fixture
def composed():
    from hydra import compose, initialize_config_module

    import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable

    with initialize_config_module("autobatch.conf", version_base="1.3"):
        yield lambda *overrides: compose("train", overrides=["device=cpu", "model=mlp", "data.shape=[4]", *overrides])


def _loss(target="torch.nn.CrossEntropyLoss", **arguments):
    return OmegaConf.create({"train": {"checkpoint_dir": "checkpoints"}, "loss": {"_target_": target, **arguments}})


def _step(loss_fn):
    from autobatch import TrainStep

    model = torch.nn.Linear(4, 3)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                     lambda n: (torch.randn(n, 4), torch.randint(0, 3, (n,))))


def test_review32_the_loss_group_builds_the_criterion_probe_and_train_use(composed):
    """The command line trained with cross-entropy only: ``+loss.label_smoothing``, class weights or
    another criterion had no key. Each is built, applied to the logits as before, and keyed."""
    from autobatch.cli.build import validate
    from autobatch.cli.loss import build_loss
    from autobatch.planning.loss_reduction import seen_reduction
    from autobatch.probe.caching.cache_key import step_components

    cpu = torch.device("cpu")
    assert build_loss(_loss(), cpu) is cross_entropy_loss  # the default (and no loss key): today's loss, unchanged
    assert build_loss(OmegaConf.create({}), cpu) is cross_entropy_loss
    cfg = composed("+loss.label_smoothing=0.1", "+loss.weight=[1.0,2.0,3.0]")
    validate(cfg)
    loss_fn = build_loss(cfg, cpu)
    model, batch = Returns(lambda x: Output(x)), (torch.randint(0, 11, (2, 4)), torch.randint(0, 3, (2, 4)))
    model.embed = torch.nn.Embedding(11, 3)
    expected = F.cross_entropy(model.embed(batch[0]).reshape(-1, 3), batch[1].reshape(-1), label_smoothing=0.1,
                               weight=torch.tensor([1.0, 2.0, 3.0]))
    assert torch.allclose(loss_fn(model, batch), expected)  # .logits read, [B, T, V] flattened, the arguments taken
    keys = {step_components(_step(fn))["code"]["loss_fn"] for fn in (cross_entropy_loss, loss_fn)}
    assert len(keys) == 2  # another loss, another probe cache entry
    summed = build_loss(_loss(reduction="sum"), cpu)
    assert seen_reduction(summed) == "loss_fn = CrossEntropyLoss(reduction='sum')"  # the runner's replay warning
    mse = build_loss(_loss("torch.nn.MSELoss"), cpu)
    regression = torch.nn.Linear(4, 2)
    inputs, targets = torch.randn(3, 4), torch.randn(3, 2)
    assert torch.allclose(mse(regression, (inputs, targets)), F.mse_loss(regression(inputs), targets))
    with pytest.raises(TypeError, match=r"^the loss \(MSELoss\) compares .* but the targets are int64 \(class ids"):
        mse(regression, (inputs, torch.zeros(3, 2, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"output, shape \[3, 2\], .* the targets' shape is \[3\]"):
        mse(regression, (inputs, torch.randn(3)))  # torch only warned and broadcast to [3, 3]


def test_review32_a_loss_function_is_given_partial_and_a_bad_target_is_one_line():
    from autobatch.cli.build import _check_target
    from autobatch.cli.loss import build_loss, check_loss
    from autobatch.planning.loss_reduction import seen_reduction

    with pytest.raises(ValueError, match=r"^loss._target_=torch.nn.functional.smooth_l1_loss is a function of "
                                         r"\(output, target\).*give \+loss._partial_=true"):
        check_loss(_loss("torch.nn.functional.smooth_l1_loss"), _check_target)
    with pytest.raises(ValueError, match=r"^loss._target_='torch.nn.MSELos' cannot be imported .*did you mean "
                                         r"torch.nn.MSELoss\?"):
        check_loss(_loss("torch.nn.MSELos"), _check_target)
    with pytest.raises(ValueError, match=r"^loss.label_smoothing is not an argument of torch.nn.MSELoss"):
        check_loss(_loss("torch.nn.MSELoss", label_smoothing=0.1), _check_target)
    cfg = _loss("torch.nn.functional.smooth_l1_loss", _partial_=True, reduction="sum")
    check_loss(cfg, _check_target)
    loss_fn = build_loss(cfg, torch.device("cpu"))
    model, inputs, targets = torch.nn.Linear(4, 2), torch.randn(3, 4), torch.randn(3, 2)
    assert torch.allclose(loss_fn(model, (inputs, targets)), F.smooth_l1_loss(model(inputs), targets, reduction="sum"))
    assert seen_reduction(loss_fn) == "loss_fn = partial(smooth_l1_loss, reduction='sum')"


def test_review32_a_resume_with_another_loss_is_noted(tmp_path):
    """A resume trains with its command's loss (no state of the checkpoint); one other than the run's
    was taken silently."""
    import json

    from autobatch.cli.resume_state import loss_notes

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    checkpoint = run / "checkpoints" / "last.pt"
    (run / "train_result.json").write_text(json.dumps({"config": {"loss": {"_target_": "torch.nn.MSELoss"}}}))
    assert loss_notes(_loss("torch.nn.MSELoss"), checkpoint, None) == []  # the same loss: no news
    [note] = loss_notes(_loss(label_smoothing=0.1), checkpoint, None)  # found in the checkpoint's run directory
    assert note == ("the loss is torch.nn.CrossEntropyLoss(label_smoothing=0.1), and the run this checkpoint continues "
                    "trained with torch.nn.MSELoss: the resumed steps train with this run's (a loss is no state of the "
                    "checkpoint); give loss=mse to continue with the run's own")
    (run / "train_result.json").write_text(json.dumps({"config": {"train": {}}}))  # recorded before the loss group
    assert loss_notes(_loss(), checkpoint, run) == []  # it trained with cross-entropy


def test_review33_a_tuple_with_the_loss_first_names_the_logits_not_a_dataset():
    # (loss, logits), as a Hugging Face model given labels returns: before, "tuple index out of range"
    # with the probe's note that a dataset had fewer samples than the batch
    model = Returns(lambda x: (x.sum(), x))
    with pytest.raises(TypeError, match=r"first item is a 0-dim tensor \(items: \[\], \[2, 3, 5\]\).*return the logits first"):
        cross_entropy_loss(model, (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)))


def test_review33_int32_class_ids_train_as_int64_ones():
    # a dataset's int32 labels (numpy's default on Windows): before, torch's "expected target dtype to be
    # Long or Byte, but got Int", raised inside autobatch
    torch.manual_seed(0)
    model = Returns(lambda x: x)
    tokens, targets = torch.randint(0, 11, (3, 4)), torch.randint(0, 5, (3, 4))
    assert torch.equal(cross_entropy_loss(model, (tokens, targets.int())), cross_entropy_loss(model, (tokens, targets)))


def test_review38_a_sequence_classifier_against_token_targets_is_one_line_naming_both_shapes():
    from autobatch.cli.errors import BAD_INPUT, describe
    from autobatch.cli.loss import TargetShapeMismatch
    from autobatch.probe.trial_notes import with_trial_note

    class Classifier(torch.nn.Module):  # a text classifier: one row of logits a sample, [B, C]
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(11, 5)
            self.head = torch.nn.Linear(5, 4)

        def forward(self, tokens):
            return self.head(self.embed(tokens).mean(1))

    tokens = torch.randint(0, 11, (8, 16))
    with pytest.raises(TargetShapeMismatch) as raised:  # the synthetic data's targets: a token id a position
        cross_entropy_loss(Classifier(), (tokens, torch.randint(0, 4, (8, 16))))
    assert with_trial_note(raised.value, 8) is raised.value and not getattr(raised.value, "__notes__", None)
    message, code = describe(raised.value)
    assert code == BAD_INPUT and "raised at" not in message, message
    assert message.startswith("the model's logits have shape [8, 4] and the targets [8, 16]") and "data.dataset" in message
    assert cross_entropy_loss(Classifier(), (tokens, torch.randint(0, 4, (8,)))).isfinite()  # one id a sample still trains
