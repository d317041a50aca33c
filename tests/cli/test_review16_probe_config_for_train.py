"""``train --config-name probe`` (or a config of the user's own that extends ``probe``): the
warning said runs went to "Hydra's outputs/<date>/<time>" and sweeps got no summary, both false
for autobatch's probe config (``outputs/probe/...``, with the summary callback); what is lost
is ``optimizer.lr`` being ``train.lr``."""

from __future__ import annotations

from autobatch.cli import preflight
from conftest import SMALL


def test_a_train_run_of_the_probe_config_is_warned_about_what_it_loses(capsys, tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - probe\n  - _self_\ntrain:\n  steps: 1\n")
    capsys.readouterr()
    preflight.check("train", ["--config-dir", str(tmp_path), "--config-name", "mine", *SMALL[:3]])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autobatch: warning:")]
    assert len(warnings) == 1, warnings
    assert "mine extends autobatch's probe config, not its train config, so optimizer.lr is not train.lr" in warnings[0]
    assert "Hydra's outputs/<date>/<time>" not in warnings[0] and "no summary" not in warnings[0]
