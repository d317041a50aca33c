"""Review 29: a class of one's own given whole as a dict, ``'model={_target_: torch.nn.Linear, in_features: 4,
out_features: 2}'``, without ``model=target``. Hydra merged the dict into the default ``gpt`` option: the
line was "model (GPTConfig) has no key 'in_features'" with advice (``+model.in_features``) that led to a
second error, and a class taking ``**kwargs`` was built silently with ``gpt``'s ``vocab_size``, ``layers``...
Now one line names the ``target`` option's form, which builds the dict's class with the dict's arguments
only (docs/cli.md). Checked as :func:`autobatch.cli.preflight.check` checks a command line, in-process."""

from __future__ import annotations

import pytest
import torch
from hydra import compose

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import validate
from autobatch.cli.dict_target import check_dict_target
from autobatch.cli.errors import CLIError
from autobatch.cli.preflight import check
from autobatch.cli.user_config import composing

CPU = ["device=cpu", "probe.cache=false", "probe.max_batch=2"]


class _TakesAnything(torch.nn.Module):
    """A model that takes ``**kwargs`` (as many library models do): extra keys do not fail its build."""

    def __init__(self, width: int = 4, **kwargs: object) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 2)


def test_a_dict_model_without_the_target_option_names_the_form_that_builds_it():
    with pytest.raises(CLIError) as caught:
        check("probe", [*CPU, "model={_target_: torch.nn.Linear, in_features: 4, out_features: 2}"])
    message = str(caught.value)
    assert "\n" not in message and "(model=gpt)" in message and "vocab_size" in message
    assert message.endswith("python -m autobatch probe model=target model._target_=torch.nn.Linear "
                            "+model.in_features=4 +model.out_features=2"), message


def test_a_class_taking_kwargs_is_no_longer_built_silently_with_the_default_options_keys():
    with pytest.raises(CLIError, match=r"model=target model\._target_=\S+_TakesAnything \+model\.width=3$"):
        check("probe", [*CPU, f"model={{_target_: {__name__}._TakesAnything, width: 3}}"])


def test_the_named_form_builds_exactly_the_dict_and_a_merge_into_the_same_class_stays():
    with composing("probe", None):
        cfg = compose("probe", overrides=[*CPU, "model=target", "model._target_=torch.nn.Linear",
                                          "+model.in_features=4", "+model.out_features=2"])
        assert {k: cfg.model[k] for k in cfg.model if k != "inputs"} == {
            "_target_": "torch.nn.Linear", "in_features": 4, "out_features": 2}
        validate(cfg)
        check_dict_target("probe", [*CPU, "model={_target_: autobatch.workloads.models.GPT, layers: 1}"], "probe")


def test_a_nested_dict_is_named_as_itself_added_to_the_target_option():
    nested = "model={_target_: torch.nn.Sequential, _args_: [{_target_: torch.nn.Linear, in_features: 4, out_features: 2}]}"
    with composing("probe", None):
        with pytest.raises(CLIError, match=r"model=target '\+model=\{_target_: torch\.nn\.Sequential"):
            check_dict_target("probe", [*CPU, nested], "probe")  # no key-by-key form: the dict, added with +
        assert compose("probe", overrides=[*CPU, "model=target", f"+{nested}"]).model._args_[0].in_features == 4
