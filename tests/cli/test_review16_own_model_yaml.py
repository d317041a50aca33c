"""A YAML of the user's own that gives ``model: {_target_: my.Net, dim: 64}`` under the default
``model: gpt`` option: the keys are checked against GPT's schema, and the line listed its keys
without saying how to give a class of one's own (``- override model: target``)."""

from __future__ import annotations

import pytest

from autobatch.cli import preflight
from autobatch.cli.errors import CLIError


def test_an_own_model_under_the_default_option_says_to_override_it(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\nmodel:\n  _target_: torch.nn.Linear\n"
                                        "  in_features: 16\n")
    with pytest.raises(CLIError) as raised:
        preflight.check("train", ["--config-dir", str(tmp_path), "--config-name", "mine"])
    message = raised.value.message
    assert message.startswith("mine.yaml sets model.in_features, but model has no key 'in_features'; its keys: ")
    assert message.endswith("for a model class of your own, put `- override model: target` in the defaults list")
