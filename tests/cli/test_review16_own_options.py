"""Group options of the user's own (``--config-dir myconf model=tiny``): a required key left
unset, and a misspelt constructor argument.

* ``myconf/model/tiny2.yaml`` extends ``schema_model_mlp`` but omits ``in_shape``: the run failed
  inside Hydra's instantiate as "Missing mandatory value: in_shape", naming no group.
* ``model.hiden=3`` on a ``_target_`` node that has ``hidden`` got Hydra's advice only
  ("To append to your config use +model.hiden=3"), which adds a second, misspelt argument.
"""

from __future__ import annotations

import pytest

from autobatch.cli import preflight
from autobatch.cli.errors import CLIError


def _refused(*args: str) -> str:
    with pytest.raises(CLIError) as raised:
        preflight.check("probe", list(args))
    assert raised.value.exit_code == 2
    return raised.value.message


def test_a_required_key_an_own_option_omits_is_named_before_the_run(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("defaults:\n  - /schema_model_mlp@_here_\nwidth: 16\n")
    message = _refused("--config-dir", str(tmp_path), "model=tiny", "data.shape=[16]")
    assert message.startswith("model.in_shape, model.num_classes have no value (??? in the config)")
    assert "model.in_shape=VALUE" in message


def test_a_misspelt_argument_of_a_target_node_names_the_closest_one():
    message = _refused("model=target", "model._target_=torch.nn.Linear", "+model.in_features=4", "model.in_featurs=8")
    assert message == ("Could not override 'model.in_featurs': model has no key 'in_featurs' (did you mean "
                       "model.in_features?); +model.in_featurs=VALUE adds it as a new argument")
    assert "To append to your config use +model.zzz=3" in _refused("model=target", "model.zzz=3")  # nothing near
