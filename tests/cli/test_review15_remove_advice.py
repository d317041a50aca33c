"""Review 15: "not an argument of" advises a fix that works.

``optimizer._target_=torch.optim.Adagrad`` (adamw's ``betas`` left over) and
``model._target_=my.Model`` over ``model=mlp`` (its ``in_shape``) said "Remove it with
~optimizer.betas", which Hydra then refused ("AdamWConfig (DictConfig) does not support
deletion"): a key of the option's schema cannot be removed. The line now names the option that
starts without it; ``~`` is advised only for a key that can go.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import validate


@pytest.fixture
def conf():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        yield lambda *overrides: compose("probe", overrides=list(overrides))


def test_a_schema_key_left_over_names_the_option_to_start_from(conf):
    with pytest.raises(ValueError) as raised:
        validate(conf("optimizer._target_=torch.optim.Adagrad"))
    assert "~optimizer.betas is refused" in str(raised.value) and "start from optimizer=target" in str(raised.value)
    with pytest.raises(ValueError, match=r"\(MLPConfig\).*start from model=target"):
        validate(conf("model=mlp", "model._target_=torch.nn.Linear"))
    validate(conf("optimizer=target", "optimizer._target_=torch.optim.Adagrad"))  # the fix it names works


def test_a_free_key_is_removed_as_advised(conf):
    with pytest.raises(ValueError, match=r"Remove it with ~data.dataset.extra"):
        validate(conf("data=dataset", "+data.dataset.extra=1"))
    validate(conf("data=dataset", "+data.dataset.extra=1", "~data.dataset.extra"))


@pytest.mark.parametrize("override, said", [
    # Hydra: "TrainConfig (DictConfig) does not support deletion"
    ("~train.steps", "~train.steps: train.steps is a key of TrainConfig, which keeps its keys; set train.steps=VALUE"),
    # Hydra: "'probe.memory_limit' does not exist", of a key that is there, null
    ("~probe.memory_limit", "~probe.memory_limit: probe.memory_limit is null already, so there is nothing to remove"),
    ("~probe.memry_limit", "~probe.memry_limit: probe has no key 'memry_limit' (did you mean probe.memory_limit?)"),
])
def test_a_removal_hydra_refuses_says_what_to_do(override, said):
    from autobatch.cli.errors import CLIError
    from autobatch.cli.preflight import check

    with pytest.raises(CLIError) as raised:
        check("probe", ["model=mlp", override])
    assert raised.value.message.startswith(said), raised.value.message
