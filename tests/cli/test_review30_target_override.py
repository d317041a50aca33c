"""Review 30: ``model._target_=mypkg.MyModel`` without ``model=target`` keeps the default option (``gpt``),
so a class that takes ``**kwargs`` was built silently with ``gpt``'s ``vocab_size``, ``layers``... (a class
without ``**kwargs`` was already refused, naming each key it lacks). It is now the line a dict given whole
gets (:mod:`autobatch.cli.dict_target`), naming the ``target`` form, on every job of a sweep too. A class
that takes each of the option's keys by name (``optimizer._target_=torch.optim.Adam``, docs/cli.md) is built."""

from __future__ import annotations

import pytest
import torch

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.dict_target import check_dict_target
from autobatch.cli.errors import CLIError
from autobatch.cli.preflight import job_overrides
from autobatch.cli.user_config import composing

CPU = ["device=cpu", "probe.cache=false", "probe.max_batch=2"]
OWN = f"{__name__}._TakesAnything"


class _TakesAnything(torch.nn.Module):
    """A model that takes ``**kwargs``, as many library models do."""

    def __init__(self, width: int = 4, **kwargs: object) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 2)


class _AnyOptimizer(torch.optim.SGD):
    """An optimizer that takes ``**kwargs`` (adamw's ``betas`` would land there)."""

    def __init__(self, params, lr: float = 0.1, **kwargs: object) -> None:
        super().__init__(params, lr=lr)


def test_a_kwargs_model_target_without_the_target_option_names_the_target_form():
    with composing("probe", None), pytest.raises(CLIError) as caught:
        check_dict_target("probe", [*CPU, f"model._target_={OWN}", "model.layers=3"], "probe")
    message = str(caught.value)
    assert "\n" not in message and "(model=gpt)" in message and "vocab_size" in message
    assert message.endswith(f"python -m autobatch probe model=target model._target_={OWN} +model.layers=3"), message


def test_a_kwargs_optimizer_target_is_refused_on_each_job_of_a_sweep():
    with composing("probe", None):  # preflight.check runs check_dict_target on every job of a sweep
        jobs = job_overrides([*CPU[:-1], "probe.max_batch=2,4", f"optimizer._target_={__name__}._AnyOptimizer"], True)
        with pytest.raises(CLIError, match=r"\(optimizer=adamw\), whose keys \(weight_decay, betas\) .*optimizer=target "
                                           rf"optimizer._target_={__name__}\._AnyOptimizer$"):
            check_dict_target("probe", jobs[-1], "probe")


def test_a_class_taking_the_options_keys_by_name_or_under_model_target_is_left_to_build():
    with composing("probe", None):
        check_dict_target("probe", [*CPU, "optimizer._target_=torch.optim.Adam", "+optimizer.amsgrad=true"], "probe")
        check_dict_target("probe", [*CPU, "model=target", f"model._target_={OWN}", "+model.width=3"], "probe")
