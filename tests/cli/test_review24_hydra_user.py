"""An ML engineer's own Hydra configs against ``python -m autobatch``: what read as Hydra's or
OmegaConf's words, or named a key the user never set, now names the key and what to change.

* ``train: {lr: ${oc.env:MYLR}}`` in a config of one's own, ``MYLR`` unset: the error named
  ``optimizer.lr`` (the packaged ``${train.lr}`` that reads it), and the run's line gave no fix.
* ``model.bais=false`` on an option of one's own whose class takes ``bias``, which the YAML leaves
  out: Hydra's "Key 'bais' is not in struct", no hint of ``bias``; ``model.in_features=3`` under
  ``model=target``: Hydra's advice, without why ``+`` is needed.
* Two ``???`` keys: the fix showed only the first one's ``KEY=VALUE``.
* ``main()`` called again in one process after a sweep: a single run (or ``--info``) printed the
  earlier sweep's table again.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from autobatch.cli import preflight
from autobatch.cli.errors import CLIError, describe
from autobatch.cli.sweep import SweepSummary, last_sweep_dir
from autobatch.cli.commands import run_app

_VAR = "AUTOBATCH_REVIEW24_UNSET_LR"


def _refused(*args: str, command: str = "train") -> str:
    with pytest.raises(CLIError) as raised:
        preflight.check(command, list(args))
    assert raised.value.exit_code == 2
    return raised.value.message


def _own(tmp_path: Path, **files: str) -> Path:
    for name, text in files.items():
        path = tmp_path / "myconf" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "myconf"


_ENV_CONFIG = f"defaults:\n  - train\n  - override model: mlp\n  - _self_\ndata:\n  shape: [8]\ntrain:\n  lr: ${{oc.env:{_VAR}}}\n"


@pytest.mark.parametrize("flags", [[], ["--cfg", "job", "--resolve"]], ids=["run", "cfg-resolve"])
def test_an_unset_environment_variable_names_the_key_that_reads_it(tmp_path, monkeypatch, flags):
    monkeypatch.delenv(_VAR, raising=False)
    conf = _own(tmp_path, mine=_ENV_CONFIG)
    message = _refused("--config-dir", str(conf), "--config-name", "mine", *flags)
    assert message.startswith(f"train.lr=${{oc.env:{_VAR}}}: " if flags else "train.lr: "), message  # not optimizer.lr
    assert f"set the environment variable {_VAR} (export {_VAR}=...) or give train.lr=VALUE" in message


def test_an_interpolation_failing_at_run_time_names_the_key_that_holds_it(monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.delenv(_VAR, raising=False)
    cfg = OmegaConf.create({"train": {"lr": f"${{oc.env:{_VAR}}}"}, "optimizer": {"lr": "${train.lr}"}})
    with pytest.raises(Exception) as raised:
        _ = cfg.optimizer.lr  # what the run reads first
    message, code = describe(raised.value)
    assert code == 2 and message.startswith("train.lr: KeyError raised while resolving") and "give train.lr=VALUE" in message


_TINY = "_target_: torch.nn.Linear\nin_features: 8\nout_features: 10\n"


def test_a_misspelt_argument_the_option_leaves_out_is_named_from_the_constructor(tmp_path):
    conf = _own(tmp_path, **{"model/tiny": _TINY})
    message = _refused("--config-dir", str(conf), "model=tiny", "data.shape=[8]", "model.bais=false")
    assert message == ("Could not override 'model.bais': model has no key 'bais' (did you mean +model.bias, an "
                       "argument of torch.nn.Linear that the config does not set?)")


def test_an_argument_the_target_node_lacks_says_why_plus_adds_it():
    message = _refused("model=target", "model._target_=torch.nn.Linear", "model.in_features=3")
    assert message == ("Could not override 'model.in_features': model does not set 'in_features' yet (an argument "
                       "of torch.nn.Linear); add it with +model.in_features=3")


def test_every_key_left_unset_is_given_in_the_fix(tmp_path):
    conf = _own(tmp_path, **{"model/tiny": "_target_: torch.nn.Linear\nin_features: ???\nout_features: ???\n"})
    message = _refused("--config-dir", str(conf), "model=tiny", "data.shape=[8]")
    assert message.endswith("on the command line: model.in_features=VALUE model.out_features=VALUE"), message


def test_a_command_after_a_sweep_in_the_same_process_reports_no_sweep(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}, "runtime": {"cwd": str(tmp_path)}}})
    SweepSummary().on_multirun_start(config)  # what an earlier main(["probe", "-m", ...]) left recorded
    assert last_sweep_dir() == tmp_path / "sweep"
    monkeypatch.setattr("sys.argv", ["autobatch probe", "--cfg", "job", "model=mlp"])
    with contextlib.suppress(SystemExit):
        run_app("probe")  # one run, not a sweep: prints the config
    assert last_sweep_dir() is None
