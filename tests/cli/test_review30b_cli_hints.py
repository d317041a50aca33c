"""Review 30b: near misses of a closed set, and a ``_target_`` set on a chosen option.

``cache lst`` and ``probe.strategy=halvng`` listed the valid choices but named none of them; the closest is
now named (``did you mean cache list?``), as for a misspelt key or group option. ``model=mlp
model._target_=mypkg.MyModel`` with a class that takes ``**kwargs`` built it silently with mlp's ``in_shape``,
``width``...: the explicit option was skipped by the check that names the ``model=target`` form. It is now
that line; a subclass of the option's own class (``autobatch.workloads.models.MLP``) still builds."""

from __future__ import annotations

import pytest
import torch
from hydra import compose

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli import preflight
from autobatch.cli.cache_command import main as cache_main
from autobatch.cli.dict_target import check_dict_target
from autobatch.cli.errors import CLIError, describe
from autobatch.cli.override_hints import override_hint
from autobatch.cli.user_config import composing
from autobatch.workloads.models import MLP

CPU = ["device=cpu", "probe.cache=false", "probe.max_batch=2"]


class _TakesAnything(torch.nn.Module):
    """A model that takes ``**kwargs``: mlp's keys would vanish into them."""

    def __init__(self, depth: int = 1, **kwargs: object) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(depth, 2)


class _WideMLP(MLP):
    """A subclass of the packaged MLP that passes mlp's keys on through ``**kwargs``."""

    def __init__(self, scale: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)


def test_a_misspelt_cache_action_names_the_closest(tmp_path):
    with pytest.raises(CLIError) as caught:
        cache_main(["lst", "--dir", str(tmp_path)])
    message = str(caught.value)
    assert "\n" not in message and "invalid choice: 'lst'" in message and "(did you mean cache list?)" in message
    with pytest.raises(CLIError) as far:  # nothing close: the choices alone
        cache_main(["xyz"])
    assert "did you mean" not in str(far.value) and "list, clear" in str(far.value)


def test_a_misspelt_choice_value_names_the_closest():
    with pytest.raises(CLIError) as caught:
        preflight.check("probe", [*CPU, "probe.strategy=halvng"])
    message = str(caught.value)
    assert "\n" not in message and "expected one of [" in message
    assert message.endswith("(did you mean probe.strategy=halving?)"), message


def test_a_kwargs_target_on_a_chosen_option_names_the_target_form():
    own = f"{__name__}._TakesAnything"
    with composing("probe", None), pytest.raises(CLIError) as caught:
        check_dict_target("probe", [*CPU, "model=mlp", f"model._target_={own}", "model.width=8"], "probe")
    message = str(caught.value)
    assert "\n" not in message and "(model=mlp)" in message and "in_shape" in message and "layers" in message
    assert "width" not in message.split("; ")[0].split("whose keys")[1]  # the user's own key is meant for it
    assert message.endswith(f"python -m autobatch probe model=target model._target_={own} +model.width=8"), message


def test_a_subclass_of_the_chosen_options_class_is_left_to_build():
    with composing("probe", None):
        check_dict_target("probe", [*CPU, "model=mlp", f"model._target_={__name__}._WideMLP"], "probe")
        check_dict_target("probe", [*CPU, "model=mlp", f"model._target_={__name__}._WideMLP", "+model.scale=3"], "probe")


@pytest.mark.parametrize("key, words", [
    ("model.bias", "model does not set 'bias' yet (an argument of torch.nn.Linear); add it with +model.bias=true,false"),
    ("data.dataset._target_", "data.dataset is null (nothing is set there yet); add it with +data.dataset._target_=true,false"),
])
def test_review37_an_unset_argument_swept_without_plus_names_the_whole_sweep(key, words):
    """``-m model.bias=true,false`` on a ``model=target`` that does not set ``bias`` was told ``add it with
    +model.bias=true``: Hydra composes a sweep job by job, and its advice held job 0's value, so the line
    dropped the sweep's other values. It gives the command line's value whole."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"model": {"_target_": "torch.nn.Linear", "in_features": 2}, "data": {"dataset": None}})
    OmegaConf.set_struct(cfg, True)
    with pytest.raises(Exception) as caught:
        OmegaConf.update(cfg, key, True, merge=True)
    hydra = f"Could not override '{key}'. To append to your config use +{key}=true Key '{key}' is not in struct"
    assert words in override_hint(hydra, caught.value, [*CPU, "model=target", f"{key}=true,false"])


def test_review37_a_class_given_as_a_groups_option_names_the_target_form():
    """``model=mynet.Net`` (an import path where an option goes) was Hydra's "Could not find 'model/mynet.Net'"
    with the options listed, ``target`` unexplained; ``loss=`` alone named its ``_target_`` form."""
    hydra = ("In 'probe': Could not find 'model/mynet.Net' Available options in 'model': cnn gpt mlp resnet50 target")
    assert override_hint(hydra).endswith("(model=mynet.Net names no option; a class by import path: model=target "
                                         "model._target_=mynet.Net (+model.<argument>=VALUE for each argument))")
    data = "In 'probe': Could not find 'data/mynet.DS' Available options in 'data': dataset imagenet synthetic"
    assert "+data.dataset._target_=mynet.DS (" in override_hint(data)


def test_review38_device_gpu_is_told_cuda_not_the_closest_spelling_cpu():
    """``device=gpu`` was told ``did you mean device=cpu?`` (the nearest letters), the opposite of what was meant."""
    hydra = "In 'probe': Could not find 'device/GPU' Available options in 'device': auto cpu cuda"
    assert override_hint(hydra).endswith("(did you mean device=cuda?)"), override_hint(hydra)
    omegaconf = ("Error merging override device.type=gpu: Invalid value 'gpu', expected one of [auto, cuda, cpu]")
    assert override_hint(omegaconf).endswith("(did you mean device.type=cuda?)"), override_hint(omegaconf)



@pytest.mark.parametrize("overrides, says", [
    (["optimizer.momentun=0.9"], "did you mean momentum? It is a key of optimizer=sgd, not of the optimizer chosen: "
                                 "choose that one with optimizer=sgd optimizer.momentum=0.9"),
    (["optimizer=sgd", "optimizer.betas=[0.9,0.99]"], "betas is a key of optimizer=adamw"),
])  # fmt: skip
def test_review38_a_key_of_another_option_names_that_option(overrides, says):
    """``optimizer.momentun=0.9`` under the default adamw was told ``+optimizer.momentun=VALUE``,
    which AdamW then refuses: sgd's momentum (adamw's betas under sgd) is named with its option."""
    with composing("probe"), pytest.raises(Exception) as raised:
        compose("probe", overrides=overrides)
    message = override_hint(describe(raised.value)[0], raised.value, overrides)
    assert says in message and "+optimizer" not in message, message
