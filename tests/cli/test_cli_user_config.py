"""A config of the user's own (``--config-dir``, ``--config-name``): the documented one, which
extends the packaged config, keeps its wiring (the optimizer's lr is ``train.lr``, the run
directories ``train.resume=latest`` searches, the recorded command); one that does not extend
it is named in a warning, or refused in one line when it lacks keys.

In-process runs (``autobatch.__main__.main``) of a tiny MLP.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from autobatch.__main__ import main
from autobatch.cli.key_source import _chosen, kept_under_missing
from autobatch.cli.user_config import composing, help_overrides

from conftest import REPO


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)


def _documented_config(directory: Path) -> Path:
    """Write docs/cli.md's ``myconf/mytrain.yaml`` example into ``directory``."""
    text = (REPO / "docs" / "cli.md").read_text()
    block = re.search(r"```yaml\n# myconf/mytrain.yaml\n(.*?)```", text, re.S)
    assert block, "docs/cli.md lost its myconf/mytrain.yaml example"
    directory.mkdir(exist_ok=True)
    (directory / "mytrain.yaml").write_text(block.group(1))
    return directory


def _results(tmp_path: Path) -> list[dict]:
    found = sorted((tmp_path / "outputs" / "train").glob("**/train_result.json"))
    return [json.loads(path.read_text()) for path in found]


def test_the_documented_config_keeps_the_packaged_wiring_and_resumes_with_latest(tmp_path, capsys):
    conf = _documented_config(tmp_path / "myconf")
    flags = ["--config-dir", "myconf", "--config-name", "mytrain"]
    assert main(["train", *flags]) == 0
    assert "warning" not in capsys.readouterr().err
    first = _results(tmp_path)
    assert len(first) == 1  # in Hydra's run directory of the packaged train config: outputs/train/<date>/<time>
    assert first[0]["config"]["optimizer"]["lr"] == 0.5 == first[0]["config"]["train"]["lr"]
    assert first[0]["command"] == f"python -m autobatch train --config-dir {conf} --config-name mytrain"
    assert first[0]["steps"] == 3
    assert main(["train", *flags, "train.steps=6", "train.resume=latest"]) == 0  # found under outputs/train
    last = max(_results(tmp_path), key=lambda result: result["steps"])
    assert last["steps"] == 6 and last["resumed_from"]


def test_a_config_that_does_not_extend_the_packaged_one(tmp_path, capsys):
    conf = tmp_path / "myconf"
    conf.mkdir()
    (conf / "bare.yaml").write_text("train:\n  lr: 0.5\n")
    assert main(["train", "--config-dir", str(conf), "--config-name", "bare"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config-name bare has no model" in err and "defaults: [train, _self_]" in err
    whole = "\n".join(["defaults:", *(f"  - {g}" for g in ["train_schema", "model: mlp", "data: synthetic",
                       "optimizer: adamw", "probe: default", "train: default", "plan: default", "device: auto",
                       "_self_"]), "data:", "  shape: [16]", "train:", "  micro_batch: 4", "  steps: 1", "  lr: 0.5"])
    (conf / "whole.yaml").write_text(whole + "\n")
    assert main(["train", "--config-dir", str(conf), "--config-name", "whole", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err
    assert "autobatch: warning: --config-name whole does not extend autobatch's train config" in err
    assert "optimizer.lr is not train.lr" in err and "defaults: [train, _self_]" in err
    result = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert result["command"].startswith("python -m autobatch train --config-dir")  # not Hydra's job name


@pytest.mark.parametrize("args, words", [
    (["--config-dir", "nosuchdir"], "--config-dir nosuchdir: "),
    (["--config-dir=afile"], "is a file, not a directory"),
    (["--config-name=nosuch"], "--config-name nosuch: no nosuch.yaml in autobatch's configs"),
    (["-cd", "myconf", "-cn", "nosuch"], "no nosuch.yaml in myconf or autobatch's configs"),
    (["--config-path", "myconf"], "give your config's directory with --config-dir DIR"),
    (["--shell-completion"], "shell completion is not available"),
    (["-sc", "install=bash"], "shell completion is not available"),
])  # fmt: skip
def test_hydras_config_flags_are_one_line_and_exit_2(tmp_path, capsys, args, words):
    (tmp_path / "myconf").mkdir()
    (tmp_path / "afile").write_text("x")
    assert main(["probe", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autobatch: error: ") and err.count("\n") == 1 and words in err, err


def test_version_at_the_top_level_and_after_a_command(capsys):
    from importlib import metadata

    from autobatch.version import __version__

    try:
        expected = metadata.version("autobatch")  # the installed distribution's, else the source's
    except metadata.PackageNotFoundError:
        expected = __version__
    for args in (["--version"], ["probe", "--version"], ["train", "model=mlp", "--version"]):
        assert main(args) == 0
        assert capsys.readouterr().out == f"autobatch {expected}\n"  # not Hydra's "Hydra 1.3.8"



def test_review34_a_key_its_class_does_not_take_names_the_yaml_that_sets_it(tmp_path):
    """Under model=target, a mistyped argument in the user's own YAML was named by its key alone,
    with command-line advice (~model.in_feature) for a value the file sets on every run. (The
    command line's preflight runs the same: autobatch.cli.preflight._validate_job.)"""
    from omegaconf import OmegaConf

    from autobatch.cli.key_source import NotAnArgument, naming_file
    from autobatch.cli.user_config import composing
    from autobatch.cli.validation import check_target_arguments

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("_target_: torch.nn.Linear\nin_feature: 16\nout_features: 2\n")
    (tmp_path / "mine.yaml").write_text("defaults:\n  - model: tiny\n  - _self_\n")
    (tmp_path / "again.yaml").write_text("defaults:\n  - model: tiny\n  - _self_\nmodel:\n  in_feature: 8\n")
    node = OmegaConf.create({"_target_": "torch.nn.Linear", "in_feature": 16, "out_features": 2})
    with pytest.raises(NotAnArgument) as raised:
        check_target_arguments("model", node, torch.nn.Linear)
    with composing("train", str(tmp_path)):
        named = {name: str(naming_file(raised.value, name, [])) for name in ("mine", "again")}
        given = str(naming_file(raised.value, "mine", ["model.in_feature=3"]))
    head = "model.in_feature is not an argument of torch.nn.Linear (did you mean in_features?); its arguments: "
    assert named["mine"].startswith(head), named
    assert named["mine"].endswith(f"Set in {tmp_path / 'model' / 'tiny.yaml'}: correct or remove it there")
    assert named["again"].endswith(f"Set in {tmp_path / 'again.yaml'}: correct or remove it there")  # merged last
    assert given.startswith(head) and given.endswith("Give +model.in_features=16 in its place (~model.in_feature removes "
                                                     "it where a config of yours sets it)")



def _train_config(directory: Path, name: str, text: str) -> Path:
    """A config of the user's own named ``name`` in ``directory`` that extends the packaged train."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.yaml").write_text("defaults:\n  - train\n  - _self_\n" + text)
    return directory


def test_review38_a_missing_value_over_a_packaged_one_is_asked_for(tmp_path):
    """``train: {lr: ???}`` (to make every run give it): OmegaConf's merge kept the packaged 0.001
    under the ``???``, and the run trained at it without a word (``--cfg job`` showed 0.001). Now
    the check asks for train.lr (:func:`preflight.check` raises it; a warning under ``--cfg``)."""
    conf = _train_config(tmp_path / "myconf", "forced", "train:\n  lr: ???\n  steps: 3\n")
    with composing("train", str(conf)):
        cfg = compose("forced")
        assert cfg.train.lr == 0.001  # what OmegaConf's merge does, and the run read
        said = kept_under_missing("forced", [], cfg)
        assert kept_under_missing("forced", ["train.lr=0.1"], cfg) is None  # given on the command line
    assert f"train.lr: ??? in {conf / 'forced.yaml'} (the 0.001 of train/default" in said, said
    assert said.endswith("set it on the command line: train.lr=VALUE (or give the value in the file)"), said


def test_review38_probe_help_with_a_train_config_names_probe(tmp_path):
    """A config extending ``train`` serves ``probe`` too: ``probe --help`` printed train's header.
    The dispatcher now gives Hydra the packaged probe's app name and header (not over the user's own)."""
    conf = _train_config(tmp_path / "myconf", "mine", "train:\n  steps: 3\n")
    flags = ["--config-dir", str(conf), "--config-name", "mine"]
    given = help_overrides("probe", ["--help", *flags])
    values = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(given)}
    assert values["hydra.help.app_name"] == "autobatch probe", values
    assert values["hydra.help.header"].startswith("autobatch probe: find the largest batch size"), values
    assert help_overrides("probe", flags) == []  # not a --help: nothing added to the run's overrides
    _train_config(conf, "own", "hydra:\n  help:\n    header: mine\n")
    assert [o.split("=")[0] for o in help_overrides("probe", ["-h", "-cd", str(conf), "-cn", "own"])] == [
        "hydra.help.app_name"]


def test_review39_a_whole_node_missing_over_a_packaged_group_is_asked_for(tmp_path):
    """``model: ???`` / ``optimizer: ???`` (a node, to make every run choose it): the packaged group
    option stayed under it and ``probe`` or ``train`` ran the packaged gpt and adamw without a word
    (only a leaf's ``???`` was named). Now one line names each and its options; a list's ``???``
    too (``data.shape``); a group chosen on the command line (``model=mlp``) gives it."""
    conf = _train_config(tmp_path / "myconf", "choose", "model: ???\noptimizer: ???\ndata:\n  shape: ???\n")
    with composing("train", str(conf)):
        cfg = compose("choose")
        assert cfg.model.layers == 2 and cfg.data.shape == [3, 32, 32]  # what OmegaConf's merge keeps, and the run read
        said = kept_under_missing("choose", [], cfg)
        repository = GlobalHydra.instance().config_loader().repository
        assert _chosen("model", ["model=mlp"], repository) and not _chosen("model", ["model.width=8"], repository)
    path = conf / "choose.yaml"
    assert said.startswith(f"model: ??? in {path} (what model/gpt sets stays under it); optimizer: ??? in {path} (what "
                           f"optimizer/adamw sets stays under it); data.shape: ??? in {path} (the [3, 32, 32] of "
                           "data/synthetic stays under it): "), said
    assert ("set each on the command line: model=OPTION (one of cnn, gpt, mlp, resnet50, target) optimizer=OPTION (one "
            "of adamw, sgd, target) data.shape=VALUE (or give the value in the file; a group's option as `- override "
            "model: OPTION` in its defaults list, in place of the ???)") in said, said
