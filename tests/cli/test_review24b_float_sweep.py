"""Review 24: an integer key swept with a float ``range`` (``train.steps=range(1,2.5,0.5)``:
Hydra's ``range`` makes floats for a float step or bound) failed with OmegaConf's "Error merging
override train.steps=1.0: Value '1.0' of type 'float' could not be converted to Integer", naming
neither the range nor the fix. The line now says the key takes integers and gives an integer range."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from autobatch.cli.config import register_configs
from autobatch.cli.errors import BAD_INPUT, CLIError, describe
from autobatch.cli.override_hints import integer_key_hint
from autobatch.cli.preflight import check


@pytest.mark.parametrize("given, job, end", [
    ("train.steps=range(1,2.5,0.5)", "train.steps=1.0", "sweep integers, e.g. train.steps=range(1,3)"),
    ("probe.max_batch=range(8.0,33,8)", "probe.max_batch=8.0", "sweep integers, e.g. probe.max_batch=range(8,33,8)"),
    ("probe.max_batch=12.5,8", "probe.max_batch=12.5", "probe.max_batch takes integers, not 12.5"),
])
def test_a_float_sweep_over_an_integer_key_says_the_key_takes_integers(given, job, end):
    """``job``: the override Hydra hands the first job of the sweep ``given``."""
    register_configs()
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        with pytest.raises(Exception) as raised:
            compose("probe", overrides=[job])
    message = integer_key_hint(describe(raised.value)[0], [given])
    assert message.endswith(end), message
    if "range(" in given:
        assert f"takes integers, and a range() with a float step or float bounds ({given}) makes floats" in message


def test_the_command_line_says_a_whole_float_for_an_integer_key_is_an_int():
    with pytest.raises(CLIError) as raised:
        check("probe", ["plan.timed_steps=4.0"])
    assert raised.value.exit_code == BAD_INPUT
    assert raised.value.message.endswith("plan.timed_steps takes integers, e.g. plan.timed_steps=4"), raised.value.message
