"""A list-typed key given one list too shallow (``train.inject_oom=[3,backward]``, where the form
is a list of ``[step, phase]`` pairs; ``train.inject_oom_ranks=1``) got OmegaConf's "int is not a
ListConfig, list or tuple", naming neither the form nor the fix; the line now gives the override
written one list deeper (found by the CLI round)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from autobatch.cli.errors import BAD_INPUT, describe
from autobatch.cli.config import register_configs


@pytest.mark.parametrize("override, fix", [
    ("train.inject_oom=[3,backward]", "train.inject_oom takes a list of lists: train.inject_oom=[[3,backward]]"),
    ("train.inject_oom_ranks=1", "train.inject_oom_ranks takes a list: train.inject_oom_ranks=[1]"),
])
def test_a_list_given_one_level_too_shallow_is_shown_deeper(override, fix):
    register_configs()
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        with pytest.raises(Exception) as raised:
            compose("train", overrides=[override])
    message, code = describe(raised.value)
    assert code == BAD_INPUT and message.endswith(fix), message
