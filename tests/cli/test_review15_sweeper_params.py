"""Review 15: a sweep a YAML of the user's own sets in ``hydra.sweeper.params`` is checked.

The check before Hydra runs composed the command line's jobs only, so a misspelt key among the
YAML's sweeper params (``model.widht: 16,32``) reached Hydra's sweeper, which printed it over
five lines with exit status 1, advising ``+model.widht=16``. Each of its jobs is now composed
and checked as the command line's are (a key the command line sets wins, as in Hydra).
"""

from __future__ import annotations

import pytest

from autobatch.cli.errors import CLIError
from autobatch.cli.preflight import check

SWEEP = """\
defaults:
  - probe
  - override model: mlp
  - _self_
hydra:
  mode: MULTIRUN
  sweeper:
    params:
      {key}: 16,32
      probe.max_batch: 0,8
"""


def test_the_configs_sweeper_params_are_checked(tmp_path):
    (tmp_path / "mysweep.yaml").write_text(SWEEP.format(key="model.widht"))
    with pytest.raises(CLIError, match=r"model \(MLPConfig\) has no key 'widht' \(did you mean model.width\?\)"):
        check("probe", ["--config-dir", str(tmp_path), "--config-name", "mysweep", "probe.max_batch=8"])
    (tmp_path / "mysweep.yaml").write_text(SWEEP.format(key="model.width"))
    # the YAML's probe.max_batch=0 job would be refused: the command line's key wins, as in Hydra
    check("probe", ["--config-dir", str(tmp_path), "--config-name", "mysweep", "probe.max_batch=8"])
