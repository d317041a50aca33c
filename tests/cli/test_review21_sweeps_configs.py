"""Review 21: a user's own config directory, model and sweeps.

* A sweep's one ``autobatch: error:`` line, which Hydra prints alone before the summary table,
  did not say which job it was (``tests/cli/test_cli_sweep.py`` checks the line in a sweep).
* A YAML of ``--config-dir`` with a packaged config's path (``myconf/model/mlp.yaml`` edited to
  ``width: 7``, ``myconf/probe.yaml``) was never read, without a word: the packaged one comes first.
* A model of one's own with fewer outputs than the synthetic data's classes failed with torch's
  "Target 5 is out of bounds" and the probe's note that a dataset was smaller than the batch.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from autobatch.cli import preflight
from autobatch.cli.errors import BAD_INPUT, CLIError, describe
from autobatch.cli.loss import TargetOutOfRange, cross_entropy_loss
from autobatch.cli.sweep import _job_row
from autobatch.cli.user_config import shadowed
from autobatch.probe.trial_notes import with_trial_note


def test_a_failed_jobs_label_is_in_its_line_and_survives_a_launchers_pickling_but_not_in_its_row():
    error = pickle.loads(pickle.dumps(CLIError("No batch size fits", 1, job="job 3 (model=gpt)")))  # joblib's way
    assert str(error) == "autobatch: error: job 3 (model=gpt): No batch size fits" and error.exit_code == 1
    config = OmegaConf.create({"hydra": {"job": {"num": 3}, "overrides": {"task": ["model=gpt"]}}})
    row = _job_row(config, JobReturn(overrides=["model=gpt"], status=JobStatus.FAILED, _return_value=error))
    assert row["error"] == "No batch size fits"  # the row is the job's already


def test_a_config_dir_yaml_with_a_packaged_configs_path_is_named(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mlp.yaml").write_text("defaults:\n  - /schema_model_mlp@_here_\n  - _self_\nwidth: 7\n")
    (tmp_path / "probe.yaml").write_text("defaults:\n  - probe_schema\n  - _self_\n")
    (tmp_path / "model" / "tiny.yaml").write_text("_target_: torch.nn.Linear\nin_features: 4\nout_features: 2\n")
    warning = shadowed(str(tmp_path))  # preflight.check's first warning (a compose: 0.6 s, so not run here)
    assert f"{tmp_path / 'model' / 'mlp.yaml'}, {tmp_path / 'probe.yaml'}: never read" in warning, warning
    assert "model=my_mlp" in warning and "--config-name my_probe" in warning and "tiny" not in warning


def test_the_packaged_conf_given_as_config_dir_is_not_named():
    conf = preflight.__file__.rsplit("autobatch", 1)[0] + "conf"
    assert shadowed(conf) is None


def test_a_target_the_models_logits_have_no_class_for_names_data_num_classes():
    model = torch.nn.Linear(4, 5)
    with pytest.raises(TargetOutOfRange) as raised:
        cross_entropy_loss(model, (torch.randn(6, 4), torch.tensor([0, 1, 9, 2, -100, 3])))
    assert with_trial_note(raised.value, 64) is raised.value and not getattr(raised.value, "__notes__", None)
    message, code = describe(raised.value)
    assert code == BAD_INPUT
    assert message.startswith("a target is class id 9, but the model's logits have 5 classes") and "data.num_classes=5" in message
    assert cross_entropy_loss(model, (torch.randn(2, 4), torch.tensor([4, -100]))).isfinite()  # ignore_index still taken
