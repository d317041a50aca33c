"""Review 19: what a Hydra user tries next at the command line, checked in-process.

* ``--help`` (``--hydra-help``) after a misspelt override was Hydra's traceback: Hydra composes
  the overrides for its help outside its error reporting. Now one line, as without ``--help``.
* ``--hydra-help`` listed Hydra's shell completion and ``--config-path``, which the dispatcher
  refuses, and failed with a traceback on any override of the app's (``model=mlp``).
* A model typed by a structured config of the user's own (a dataclass in Hydra's ConfigStore,
  without autobatch's ``inputs`` key) was refused: ``model.inputs: Key 'inputs' not in 'TinyConfig'``.
* An option of a group of the user's own that sets a key the config has not (``+extra=notes``)
  said "did you mean .train?"; ``+experiment=small`` without the ``--config-dir`` that holds
  it said "+ adds keys only to a _target_".
* A user config whose defaults list puts ``_self_`` first lost its own values without a word.
* ``hydra/launcher=joblib`` without ``-m`` was silently ignored (one run reads no launcher).
* A model returning a dict with ``"logits"`` was refused; the CLI's own "not logits" error was
  "raised at .../tenacity/__init__.py" (the runner's retry loop), not where anything is to fix.
"""

from __future__ import annotations

import importlib.resources as resources
from dataclasses import dataclass

import pytest
import torch
from hydra import compose
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict
from tenacity import Retrying, stop_after_attempt

from autobatch.cli import preflight, validation
from autobatch.cli.build import cross_entropy_loss
from autobatch.cli.conf import ensure_conf_module
from autobatch.cli.errors import CLIError, describe, where_raised
from autobatch.cli.override_hints import composition_hint
from autobatch.cli.user_config import check_self_last, composing


@pytest.mark.parametrize("args, says", [
    (["--help", "probe.stratgy=x"], "did you mean probe.strategy?"),
    (["--help", "-m", "model=mlp,gpt"], "--help shows the config of one run: give model one value"),
])  # fmt: skip
def test_help_with_a_bad_override_is_one_line(args, says):
    with pytest.raises(CLIError) as raised:
        preflight.check("probe", args)
    assert says in raised.value.message, raised.value.message


def test_hydra_help_keeps_only_hydras_overrides_and_lists_the_dispatchers_flags():
    args = preflight.hydra_help_args("train", ["--hydra-help", "model=mlp", "hydra.verbose=true", "--config-dir", "d"])
    assert args == ["--hydra-help", "hydra.verbose=true", "--config-dir", "d", "hydra/hydra_help=autobatch",
                    "hydra.help.app_name=autobatch train"]
    assert preflight.hydra_help_args("train", ["model=mlp"]) == ["model=mlp"]
    text = (resources.files(ensure_conf_module()) / "hydra" / "hydra_help" / "autobatch.yaml").read_text()
    template = OmegaConf.to_container(OmegaConf.create(text), resolve=False)["template"]
    assert "--config-dir" in template and "install=bash" not in template and "$FLAGS_HELP" not in template



def test_a_launcher_given_to_one_run_is_named_as_unused(capsys):
    preflight.check("probe", ["hydra/launcher=joblib", "model=mlp"])  # Hydra runs one job and reads no launcher
    err = capsys.readouterr().err
    assert "hydra/launcher=joblib is ignored" in err and "-m" in err, err

@dataclass
class TinyConfig:  # a user's structured config: no autobatch `inputs` key
    _target_: str = "torch.nn.Linear"
    in_features: int = 16
    out_features: int = 10


def test_a_model_typed_by_a_users_own_dataclass_needs_no_inputs_key():
    cfg = OmegaConf.create({"data": {"shape": [16], "seq_len": 128, "dataset": None}})
    cfg.model = OmegaConf.structured(TinyConfig)
    validation.check_input_shape(cfg)  # raised ConfigAttributeError: Key 'inputs' not in 'TinyConfig'


@dataclass
class Top:  # a typed top level, as the apps' schemas are
    train: int = 1


def test_a_group_of_ones_own_is_named_as_a_group(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "notes.yaml").write_text("author: me\n")
    with composing("probe", str(tmp_path)), pytest.raises(ConfigCompositionException) as raised:
        compose("probe", ["+extra=notes"])
    message = composition_hint(describe(raised.value)[0], raised.value)
    assert "did you mean ." not in message and "# @package _global_" in message, message
    cfg = OmegaConf.structured(Top)
    with open_dict(cfg):
        cfg.experiment = "small"  # +experiment=small, with no --config-dir holding experiment/small.yaml
    with pytest.raises(ValueError, match=r"no config group 'experiment' .*--config-dir"):
        validation.check_unknown_keys(cfg)


def test_a_config_whose_self_comes_first_is_told_its_values_are_lost(tmp_path):
    (tmp_path / "first.yaml").write_text("defaults:\n  - _self_\n  - train\ntrain:\n  steps: 3\n")
    (tmp_path / "last.yaml").write_text("defaults:\n  - train\n  - _self_\ntrain:\n  steps: 3\n")
    with composing("train", str(tmp_path)):
        assert check_self_last("last", [], compose("last")) is None
        said = check_self_last("first", [], compose("first"))
    assert "sets train.steps: 3, but the config runs train.steps=20" in said and "put `- _self_` last" in said, said


class Returns(torch.nn.Module):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.linear, self.key = torch.nn.Linear(4, 3), key

    def forward(self, x):
        return {self.key: self.linear(x), "hidden": x}


def test_a_dict_with_logits_trains_and_one_without_says_so_without_a_place_in_tenacity():
    batch = (torch.randn(2, 4), torch.tensor([0, 2]))
    model = Returns("logits")
    expected = torch.nn.functional.cross_entropy(model.linear(batch[0]), batch[1])
    assert torch.allclose(cross_entropy_loss(model, batch), expected)
    with pytest.raises(TypeError, match=r"returned dict, not logits \(its keys: scores, hidden\)") as raised:
        for attempt in Retrying(stop=stop_after_attempt(1), reraise=True):  # the runner calls the step so
            with attempt:
                cross_entropy_loss(Returns("scores"), batch)
    assert where_raised(raised.value) == ""  # was " (raised at .../tenacity/__init__.py:...)"
